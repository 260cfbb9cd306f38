"""quantlab's own GPU kernels (Triton), each beside a plain-torch reference it is tested against (on the CPU
with Triton's interpreter, TRITON_INTERPRET=1, and on the GPU by bench/decode.py --check)."""
