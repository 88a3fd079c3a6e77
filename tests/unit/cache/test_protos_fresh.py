"""The committed generated code in protos/ matches what `python -m protos.build` produces from the .proto files."""

import importlib

from protos import build


def test_generated_code_is_fresh(tmp_path):
    written = build.generate(out_root=tmp_path)
    stale = [p.name for p in written if (build.REPO_ROOT / "protos" / p.name).read_bytes() != p.read_bytes()]
    assert not stale, f"stale generated files {stale}: run `python -m protos.build`"


def test_no_orphaned_generated_files():
    present = sorted(p.name for p in (build.REPO_ROOT / "protos").iterdir()
                     if p.name.endswith(build.GENERATED_SUFFIXES))
    assert present == build.generated_names(), "generated files without a .proto: delete them"


def test_generated_modules_import_as_package():
    for stem in ("common", "cache", "prefill", "decode", "gateway"):
        importlib.import_module(f"protos.{stem}_pb2")
        importlib.import_module(f"protos.{stem}_pb2_grpc")
    from protos import cache_pb2_grpc, decode_pb2_grpc, gateway_pb2_grpc, prefill_pb2_grpc

    assert hasattr(cache_pb2_grpc, "CacheServiceStub")
    assert hasattr(prefill_pb2_grpc, "PrefillServiceStub")
    assert hasattr(decode_pb2_grpc, "DecodeServiceStub")
    assert hasattr(gateway_pb2_grpc, "GenerationStub")
