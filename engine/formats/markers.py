"""The special-token strings of the Kimi chat formats (docs/architecture.md, "Gateway conventions").

Contract:
- Kimi K3 "XTML": a block is `<|open|>HEADER<|sep|>…<|close|>NAME<|sep|>`, a message ends with `<|end_of_msg|>`
  (the K3 stop token); images are `<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`.
  `K3_CONTROL_MARKERS` are the ones an assistant output is parsed by; `K3_STRUCTURAL_MARKERS` are every special
  token the K3 renderer may place in a prompt.
- Kimi K2 / Kimi Linear: roles `<|im_system|>`, `<|im_user|>`, `<|im_assistant|>` + role name + `<|im_middle|>` …
  `<|im_end|>` (the K2 stop token); reasoning `<think>…</think>`; tool calls
  `<|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>{json}<|tool_call_end|>…
  <|tool_calls_section_end|>`. `K2_OUTPUT_MARKERS` are the ones an assistant output is parsed by.
- Plain strings only: which of them is a special id is the tokenizer's business (`<think>` is ordinary text in the
  K2 vocabulary; the others are special tokens).
"""

from __future__ import annotations

# -- Kimi K3 (XTML) ----------------------------------------------------------------------------------------------

K3_OPEN = "<|open|>"
K3_CLOSE = "<|close|>"
K3_SEP = "<|sep|>"
K3_END_OF_MSG = "<|end_of_msg|>"
K3_MEDIA_BEGIN = "<|media_begin|>"
K3_MEDIA_CONTENT = "<|media_content|>"
K3_MEDIA_PAD = "<|media_pad|>"
K3_MEDIA_END = "<|media_end|>"

K3_CONTROL_MARKERS = (K3_OPEN, K3_CLOSE, K3_SEP, K3_END_OF_MSG)
K3_STRUCTURAL_MARKERS = K3_CONTROL_MARKERS + (K3_MEDIA_BEGIN, K3_MEDIA_CONTENT, K3_MEDIA_PAD, K3_MEDIA_END)

# -- Kimi K2 / Kimi Linear ---------------------------------------------------------------------------------------

K2_IM_SYSTEM = "<|im_system|>"
K2_IM_USER = "<|im_user|>"
K2_IM_ASSISTANT = "<|im_assistant|>"
K2_IM_MIDDLE = "<|im_middle|>"
K2_IM_END = "<|im_end|>"
K2_THINK_OPEN = "<think>"
K2_THINK_CLOSE = "</think>"
K2_SECTION_BEGIN = "<|tool_calls_section_begin|>"
K2_SECTION_END = "<|tool_calls_section_end|>"
K2_CALL_BEGIN = "<|tool_call_begin|>"
K2_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
K2_CALL_END = "<|tool_call_end|>"

K2_OUTPUT_MARKERS = (K2_THINK_OPEN, K2_THINK_CLOSE, K2_SECTION_BEGIN, K2_SECTION_END, K2_CALL_BEGIN,
                     K2_ARGUMENT_BEGIN, K2_CALL_END, K2_IM_END)

# Every marker an output parser of either format reads (the gateway keeps these special ids in parsed text).
OUTPUT_MARKERS = K3_CONTROL_MARKERS + K2_OUTPUT_MARKERS
