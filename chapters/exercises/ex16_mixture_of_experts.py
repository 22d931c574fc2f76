"""Chapter 16 exercise: the alignment step of the fused mixture-of-experts kernel, in PyTorch. It
sorts the (token, slot) pairs by expert and pads each expert's rows to whole tiles, so that every
tile of the two grouped GEMMs multiplies by one expert's weights. Write the body;
`make exercise CH=16` runs the MoE tests with it (exact alignments, then fused_moe on your
alignment against the reference). Stuck? chapters/exercises/hints/16_mixture_of_experts.md.

16.1 replaces moe_align_block_size of kernels/fused_moe.py (a Triton counting sort) wherever the
package calls it: `fused_moe` then runs its GEMMs on the tiles your function lays out.
"""
import torch

from minivllm.kernels.fused_moe import MoEAlignment, moe_padded_size


def moe_align_block_size(topk_ids, num_experts, block_m) -> MoEAlignment:
    """Exercise 16.1: the (token, slot) pairs grouped by expert in tiles of block_m rows (chapter 16,
    "3. Sorting by expert: tiles of one expert"). Replaces kernels/fused_moe.py's
    moe_align_block_size; the exact answer is moe_align_block_size_ref's, beside it.

    topk_ids: [M, topk] int32 or int64, the router's experts of each token, each in [0, num_experts).
    Pair p = token * topk + slot is the index of topk_ids.flatten(); num_pairs = M * topk.
    num_experts: E. block_m: the GEMMs' rows per tile (a power of two).

    Returns MoEAlignment(sorted_token_ids, expert_ids, num_tokens_post_padded), int32 tensors on
    topk_ids.device:
        sorted_token_ids  [moe_padded_size(num_pairs, E, block_m)]: pair ids. Expert 0's pairs first,
            then expert 1's, ...; within one expert, in increasing p. Each expert's run is padded up
            to the next multiple of block_m (an exact multiple is not padded, an expert with no pair
            takes no row). Padding and every entry past the end hold the sentinel num_pairs.
        expert_ids        [moe_padded_size(...) // block_m]: for each tile of block_m rows, the expert
            its pairs belong to (one id per tile, not per pair); -1 for the tiles past the end.
        num_tokens_post_padded  [1]: the number of rows in use (the experts' padded runs together).
    The sizes depend on the shapes only (moe_padded_size), never on the routing: the engine captures
    fused_moe in a CUDA graph. So no .item(), .tolist(), nonzero() or other host sync (on a GPU the
    tests capture your function in a graph). A loop over the experts or the pairs in Python is not
    needed: work on whole tensors.
    """
    raise NotImplementedError("exercise 16.1 (moe_align_block_size) is not written yet: fill it in, "
                              "chapters/exercises/ex16_mixture_of_experts.py; read "
                              "chapters/16_mixture_of_experts.md, '3. Sorting by expert: tiles of one expert'")
