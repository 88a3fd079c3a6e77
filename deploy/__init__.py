"""deploy: the `kdamesh` command line, the local launcher and the container/cluster manifests."""
