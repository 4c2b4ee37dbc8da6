"""The fixtures make_fixtures.py builds (one FixtureSpec each) and the constants of its checks:
prompt and continuation lengths, seeds, tolerances, the quality bar of a random model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROMPT_LEN = 12  # default prompt length T (FixtureSpec.prompt_len)
NEW_TOKENS = 32
CHAIN_DEPTH = 3
SEED = 20260529
# Tolerances of the self-consistency checks (float32 throughout); TOL_DECODE is relative
# to the largest |logit|.
TOL_DECODE = 1e-5
TOL_RELOAD = 1e-6
# The float64 numpy reference against the float32 goldens (absolute, logits up to ~15).
TOL_NUMPY = 1e-4
# Quality bar for a random model (a seed that misses it is skipped, deterministically).
MIN_DISTINCT_GREEDY = 12
MIN_EXPERT_SHARE = 0.75
MAX_ATTEMPTS = 20
# DSA fixtures (index_topk below the contexts): the index_topk-th and (index_topk+1)-th
# largest visible index scores of every sparse row must differ by more than TIE_MARGIN,
# relative to the row's max|score| (torch's CPU topk breaks exact ties in an
# implementation-defined order; the engine breaks them toward the lower index; f32
# deviates from a float64 forward by up to 5e-6 of max|score|). 1e-3 is out of reach: the
# gap is an order-statistic spacing of 9-71 scores, below 1e-3 in 3.3 % of rows, and ~290
# rows are checked (docs/fixtures.md). Attending densely instead must move the logits by at
# least MIN_DENSE_DIFF.
TIE_MARGIN = 2e-4
MIN_DENSE_DIFF = 0.1


@dataclass(frozen=True)
class FixtureSpec:
    """One tiny checkpoint: its family, config overrides and the branches it exercises."""

    name: str
    family: str  # "deepseek_v3" | "glm_moe_dsa"
    config: dict[str, Any]
    covers: list[str] = field(default_factory=list)
    prompt_len: int = PROMPT_LEN
    # Negate the second half of every indexer's query heads (``mirror_indexer_heads_``).
    mirror_indexer_heads: bool = False

    @property
    def sparse_dsa(self) -> bool:
        """True when DSA keeps fewer keys than some context of the goldens (GLM only)."""
        topk = self.config.get("index_topk")
        return self.family == "glm_moe_dsa" and topk is not None and topk < self.max_context

    @property
    def max_context(self) -> int:
        """Longest main-model context in the goldens: prompt + continuation - 1."""
        return self.prompt_len + NEW_TOKENS - 1


COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
}

SPECS: list[FixtureSpec] = [
    FixtureSpec(
        name="dsv3_a",
        family="deepseek_v3",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 48,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_interleave": True,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
        covers=[
            "q_lora_rank set (q_a_proj/q_a_layernorm/q_b_proj)",
            "first_k_dense_replace=1 (layer 0 dense, layers 1-2 MoE)",
            "noaux_tc with non-zero e_score_correction_bias",
            "group-limited routing: 16 experts, n_group=4, topk_group=2, top-4",
            "norm_topk_prob=true, routed_scaling_factor=2.5, 1 shared expert",
            "YaRN rope (factor 4, mscale=mscale_all_dim=1.0, as DeepSeek-V3 ships)",
            "rope_interleave=true, untied lm_head, rms_norm_eps=1e-6",
            "MTP layer (oracle: transformers' MtpModel)",
        ],
    ),
    FixtureSpec(
        name="dsv3_b",
        family="deepseek_v3",
        config={
            **COMMON,
            "vocab_size": 320,
            "moe_intermediate_size": 24,
            "q_lora_rank": None,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.5,
            "first_k_dense_replace": 2,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_interleave": False,
            "rope_theta": 5000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 8.0,
                "mscale": 0.8,
                "mscale_all_dim": 0.6,
                "original_max_position_embeddings": 32,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        },
        covers=[
            "q_lora_rank=null (plain q_proj)",
            "first_k_dense_replace=2 of 4 layers",
            "n_group=1 (no group limit), 8 experts top-2",
            "norm_topk_prob=false, routed_scaling_factor=1.5, n_shared_experts=2",
            "YaRN with mscale != mscale_all_dim (cos/sin attention_factor != 1,"
            " softmax scale x mscale(mscale_all_dim)^2)",
            "rope_interleave=false (half-split rope), tied embeddings (no lm_head tensor)",
            "rms_norm_eps=1e-5 while q_a/kv_a layernorms keep eps 1e-6",
            "MTP layer (oracle: transformers' MtpModel)",
        ],
    ),
    FixtureSpec(
        name="glm_a",
        family="glm_moe_dsa",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 48,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 2,
        },
        covers=[
            "glm_moe_dsa: q_lora_rank set (mandatory), interleaved rope (always)",
            "plain rope (no rope_scaling)",
            "first_k_dense_replace=1, 16 experts top-4, n_group=1",
            "norm_topk_prob=true, routed_scaling_factor=2.5, 1 shared expert",
            "DSA indexer tensors present; index_topk=64 > every context used (exact dense)",
            "rms_norm_eps=1e-5 while q_a/kv_a layernorms keep eps 1e-6",
            "MTP layer (oracle: transformers' MtpLayer + GLM decoder layer, see docs)",
        ],
    ),
    FixtureSpec(
        name="glm_b",
        family="glm_moe_dsa",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.0,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 2,
        },
        covers=[
            "glm_moe_dsa with group-limited routing (n_group=2, topk_group=1), top-3 of 8",
            "norm_topk_prob=false, routed_scaling_factor=2.0, tied embeddings",
            "YaRN rope on the interleaved GLM layout (mscale != mscale_all_dim)",
            "MTP layer (oracle: transformers' MtpLayer + GLM decoder layer, see docs)",
        ],
    ),
    FixtureSpec(
        name="glm_dsa",
        family="glm_moe_dsa",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 48,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "index_topk": 8,
            "index_head_dim": 16,
            "index_n_heads": 4,
            "indexer_types": ["full", "shared", "full", "shared"],
        },
        covers=[
            "DSA sparse: index_topk=8 < most contexts (T=40, contexts up to 71 tokens)",
            "indexer_types full/shared/full/shared (layers 1, 3 reuse the previous selection)",
            "indexer: 4 heads x 16 dims, interleaved rope on the first 8 dims; query heads"
            " 2, 3 = -(heads 0, 1), so no key scores exactly 0 (no exact ties)",
            "MTP layer with its own indexer over its own rows (indexer_types ['full'])",
            "goldens: per-layer selections dsa_topk_L, mtp_dsa_topk, int4_dsa_topk_L",
        ],
        prompt_len=40,
        mirror_indexer_heads=True,
    ),
]
