"""Triton SDConv kernels: on CPU they run in Triton's interpreter (``TRITON_INTERPRET``, set by the root
conftest); ``test_kernels_compile`` compiles them for a GPU target without one."""
