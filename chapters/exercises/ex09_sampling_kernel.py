"""Chapter 09 exercise: the Gumbel-max sampling kernel (kernels/sampling.py), one pass over a chunk of
each row's logits that draws a token (or takes the argmax of a greedy row) with noise it makes itself.
Write both bodies; `make exercise CH=09` runs the sampling kernel's tests with them. Stuck?
chapters/exercises/hints/09_sampling_kernel.md, one level at a time.

They replace `_gumbel` and `sample_chunks_kernel` of kernels/sampling.py: `sample_tokens` launches your
kernel, and `gumbel_noise` (the noise the reference adds, for the tests) calls your `_gumbel`. The host
wrapper and merge_chunks_kernel stay the engine's. Both are @triton.jit: inside, use `tl.*` operations on
blocks, not Python loops over elements or torch. On a CPU the kernel runs in Triton's interpreter, so a
`print(...)` inside shows values. Write @triton.jit helpers of your own in this file if you like.
"""
import triton
import triton.language as tl

from minivllm.kernels.sampling import UNIFORM_MAX, UNIFORM_MIN  # noqa: F401 (the clamp bounds, tl.constexpr)


@triton.jit
def _gumbel(u):
    """Exercise 09.1, the noise: standard Gumbel noise from uniforms (chapter 09, section 4, "Sampling in
    one pass: the Gumbel-max trick").

    u: a block of float32 uniforms in [0, 1) from Philox (tl.rand4x), 0 included. Returns
    g = -log(-log(u)) elementwise, after clamping u into [UNIFORM_MIN, UNIFORM_MAX] so that neither
    logarithm sees 0 or 1 (g stays finite, about -3.1 .. 16.6).
    """
    raise NotImplementedError("exercise 09.1 (_gumbel) is not written yet: fill it in, "
                              "chapters/exercises/ex09_sampling_kernel.py; read chapters/09_where_the_time_goes.md, "
                              "section 4, 'Sampling in one pass: the Gumbel-max trick'")


@triton.jit(do_not_specialize=["num_chunks"])  # one compiled variant for every batch size
def sample_chunks_kernel(
    logits_ptr, temperatures_ptr, seeds_ptr, chunk_values_ptr, chunk_ids_ptr,
    vocab_size, stride_row, chunk_size, num_chunks,
    QUARTER: tl.constexpr,
):
    """Exercise 09.1, the kernel: grid (batch, num_chunks); program (b, c) finds the best score of chunk
    c of row b and the smallest token id that has it (chapter 09, section 4).

    Row b: its logits at logits_ptr + b * stride_row + v for token id v, 0 <= v < vocab_size, float16,
    bfloat16 or float32 (compute in float32); its temperature T = temperatures_ptr[b] (float32, 0: a
    greedy row); its Philox seed seeds_ptr[b] (int64). Offsets past 2**31 elements need int64.
    Chunk c: the tokens [c * chunk_size, min((c + 1) * chunk_size, vocab_size)). chunk_size is a
    multiple of NOISE_TILE = 4 * QUARTER, so a chunk is whole noise tiles (the last one may be cut short
    by vocab_size: tokens at or past vocab_size do not exist).
    Score of token v: logit_v in a greedy row; logit_v / T + g_v in a sampled row, the division rounded
    as IEEE (tl.div_rn, what torch's logits / T does; a plain `/` may be approximate on a GPU), where
    g_v is token v's Gumbel noise, a function of (seed, v) only:
        tile t = v // NOISE_TILE,  quarter k = (v % NOISE_TILE) // QUARTER,  lane j = v % QUARTER
        g_v = _gumbel(output k of tl.rand4x(seed, t * QUARTER + j))
    (the noise gumbel_noise(seeds, vocab) writes out: the tests compare your tokens with
    sample_tokens_ref(logits, T, that noise), token for token, for any chunking.)
    Writes, at index b * num_chunks + c:
      chunk_values_ptr: the chunk's largest score (float32);
      chunk_ids_ptr:    the smallest token id with that score (int64), the way torch.argmax breaks ties.
    A score of NaN never wins; a chunk whose every score is -inf answers -inf and its first token id.
    merge_chunks_kernel (the engine's) then takes, per row, the smallest id among the chunks holding the
    row's best score.
    Stream the chunk a tile at a time (never the whole chunk in registers): keep, per lane, the best
    score seen so far and its token id, and reduce the lanes to one answer at the end.
    """
    raise NotImplementedError("exercise 09.1 (sample_chunks_kernel) is not written yet: fill it in, "
                              "chapters/exercises/ex09_sampling_kernel.py; read chapters/09_where_the_time_goes.md, "
                              "section 4, 'Sampling in one pass: the Gumbel-max trick'")
