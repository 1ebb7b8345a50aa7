"""The block drafters' settings (`train.dflash`, `train.dspark`): light, typed, imported by the
config statically (`eaglet.config.train`), apart from the networks they configure.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from eaglet.config_fields import Strict


class BlockSettings(Strict):
    """What every block drafter is made of; each method's section sets its own block_size."""

    block_size: int = Field(5, ge=1, le=33, description="Tokens per block.")
    num_layers: int = Field(
        2,
        ge=1,
        le=16,
        description="Draft decoder layers (2 on the demo: DFlash τ 3.27, DSpark τ 3.82, "
        "benchmarks/methods.py; DFlash with 1: τ 1.38).",
    )
    anchors: int = Field(
        32,
        ge=1,
        le=4096,
        description="Blocks trained per sequence per step, their anchors drawn among the "
        "positions whose next token is model output.",
    )
    mask_token_id: int | None = Field(
        None,
        ge=0,
        description="The token id of the mask slots (its embedding is the target's). Blank: the "
        "target's pad token, else its last token id.",
    )

    @property
    def drafts(self) -> int:
        """The tokens one round drafts (vLLM's num_speculative_tokens)."""
        return self.block_size - 1


class DFlashSettings(BlockSettings):
    model_config = ConfigDict(title="DFlash draft")  # the UI form's heading

    block_size: int = Field(
        5,
        ge=2,
        le=33,
        description="Tokens per block: the target's token and block_size - 1 masks, so each "
        "round drafts block_size - 1 tokens (vLLM's num_speculative_tokens; "
        "evaluate.num_speculative_tokens must equal it).",
    )


class DSparkSettings(BlockSettings):
    model_config = ConfigDict(title="DSpark draft")  # the UI form's heading

    block_size: int = Field(
        4,
        ge=1,
        le=32,
        description="Tokens per block, each a draft: the target's token predicts the first, "
        "block_size - 1 masks the others (vLLM's qwen3_dspark layout, sample_from_anchor), so "
        "each round drafts block_size tokens (evaluate.num_speculative_tokens must equal it).",
    )
    markov_rank: int = Field(
        256,
        ge=1,
        le=4096,
        description="Rank r of the Markov head: each draft's logits get a bias W2 W1[previous "
        "token] (V x r, r x V), drafted left to right (speculators' default 256).",
    )

    @property
    def drafts(self) -> int:
        return self.block_size
