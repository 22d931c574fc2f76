"""Chapter 09 exercises: the Gumbel-max sampling kernel (kernels/sampling.py). Write each function's
body; `make exercise CH=09` runs the sampling kernel's tests with them.

Both are @triton.jit device functions: use `tl.*` operations on blocks, not Python loops or torch.
On a CPU the kernel runs in Triton's interpreter, so a `print(...)` inside shows values. Keep the
signatures: the kernel calls them positionally.
"""
import triton
import triton.language as tl

from minivllm.kernels.sampling import UNIFORM_MAX, UNIFORM_MIN  # noqa: F401 (the clamp bounds, tl.constexpr)


@triton.jit
def _gumbel(u):
    """Exercise 09.1: standard Gumbel noise from uniforms (chapter 09, section 4, "Sampling in one pass:
    the Gumbel-max trick").

    u: a block of float32 uniforms in [0, 1) from Philox (tl.rand4x), 0 included. Returns
    g = -log(-log(u)) elementwise, after clamping u into [UNIFORM_MIN, UNIFORM_MAX] so that neither
    logarithm sees 0 (g stays finite, about -3.1 .. 16.6). Use tl.log, tl.minimum, tl.maximum.
    """
    raise NotImplementedError("exercise 09.1 (_gumbel) is not written yet: fill it in, "
                              "chapters/exercises/ex09_sampling_kernel.py; read chapters/09_where_the_time_goes.md, "
                              "section 4, 'Sampling in one pass: the Gumbel-max trick'")


@triton.jit
def _keep_best(row_ptr, offs, end, noise, temperature, best_value, best_id, SAMPLE: tl.constexpr):
    """Exercise 09.2: fold one quarter-tile of a row's logits into each lane's running argmax
    (chapter 09, section 4).

    row_ptr: the row's logits; offs: [QUARTER] token ids of this quarter-tile (one per lane); tokens
    at or past `end` do not exist (their score is -inf). noise: [QUARTER] Gumbel noise of those
    tokens; temperature: the row's T; best_value, best_id: [QUARTER] each lane's best score so far
    and the token id that had it. SAMPLE: the row samples (score = logit / T + noise, the division
    as tl.div_rn, the IEEE division torch does); otherwise it is greedy (score = logit).
    Load the logits as float32. A lane keeps its earlier token on a tie (the kernel visits tokens in
    increasing order, so ties go to the smallest id, as torch.argmax).
    Returns (best_value, best_id) updated.
    """
    raise NotImplementedError("exercise 09.2 (_keep_best) is not written yet: fill it in, "
                              "chapters/exercises/ex09_sampling_kernel.py; read chapters/09_where_the_time_goes.md, "
                              "section 4, 'Sampling in one pass: the Gumbel-max trick'")
