"""CUDA kernels for the serving backend, compiled at run time with NVRTC through CuPy.

See docs/kernels.md. ``kernels_cupy.attention.CupyAttention`` is the attention backend; importing this
package (or its modules) never imports CuPy: CuPy is imported inside the calls that launch kernels.
"""
