"""An independent float64 numpy forward of a fixture (the spec in docs/fixtures.md, written
without transformers), that every golden is checked against."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file as np_load_file


class NumpyReference:
    """Float64 numpy forward of a fixture directory, following docs/fixtures.md literally.

    It reads only ``config.json`` and ``model.safetensors`` and shares no code with
    transformers, so agreement with the goldens shows the written spec is complete.
    ``weights`` replaces the tensors of ``model.safetensors`` (the dequantised container).
    """

    def __init__(self, fixture_dir: Path, weights: dict[str, np.ndarray] | None = None) -> None:
        """Load the config and all tensors (as float64)."""
        self.cfg: dict[str, Any] = json.loads((fixture_dir / "config.json").read_text())
        if weights is None:
            weights = np_load_file(str(fixture_dir / "model.safetensors"))
        raw = weights
        self.w: dict[str, np.ndarray] = {k: v.astype(np.float64) for k, v in raw.items()}
        c = self.cfg
        self.n_layers = int(c["num_hidden_layers"])
        self.glm = c["model_type"] == "glm_moe_dsa"
        # DSA (GLM): "full" layers run their own indexer, "shared" ones reuse the previous
        # full layer's selection; the MTP layer always has its own indexer.
        self.index_topk = int(c.get("index_topk") or 0)
        self.idx_heads = int(c.get("index_n_heads") or 0)
        self.idx_dim = int(c.get("index_head_dim") or 0)
        self.indexer_types: list[str] = list(c.get("indexer_types") or ["full"] * self.n_layers)
        self.index_scores: dict[str, np.ndarray] = {}  # per layer prefix, from the last call
        self.shared_dense = False  # a deliberately wrong variant: "shared" layers attend densely
        self.interleave = True if self.glm else bool(c.get("rope_interleave", True))
        self.eps = float(c["rms_norm_eps"])
        self.heads = int(c["num_attention_heads"])
        self.nope = int(c["qk_nope_head_dim"])
        self.rope = int(c["qk_rope_head_dim"])
        self.v_dim = int(c["v_head_dim"])
        self.kv_lora = int(c["kv_lora_rank"])
        rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
        kind = rp.get("rope_type", rp.get("type", "default"))
        d = self.rope
        base = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        self.attn_factor = 1.0
        self.scaling = (self.nope + self.rope) ** -0.5
        if kind == "yarn":
            f = float(rp["factor"])
            l0 = float(rp["original_max_position_embeddings"])

            def m(scale: float, ms: float) -> float:
                return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

            def corr(rot: float) -> float:
                return d * math.log(l0 / (rot * 2 * math.pi)) / (2 * math.log(theta))

            low: float = max(math.floor(corr(float(rp.get("beta_fast") or 32))), 0)
            high: float = min(math.ceil(corr(float(rp.get("beta_slow") or 1))), d - 1)
            if low == high:
                high = high + 0.001
            ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
            base = base / f * ramp + base * (1 - ramp)
            ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
            self.attn_factor = m(f, ms) / m(f, ms_all) if ms and ms_all else m(f, 1.0)
            if ms_all:
                self.scaling *= m(f, float(ms_all)) ** 2
        self.inv_freq = base
        self.embed = self.w["model.embed_tokens.weight"]
        self.head = self.w.get("lm_head.weight", self.embed)

    @staticmethod
    def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """w * x / sqrt(mean(x^2) + eps) over the last axis."""
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def rotate(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """RoPE on [S, heads, d] at positions [S] (output in the de-interleaved layout)."""
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = (np.cos(ang) * self.attn_factor)[:, None, :]
        sin = (np.sin(ang) * self.attn_factor)[:, None, :]
        if self.interleave:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            a, b = x[..., : self.rope // 2], x[..., self.rope // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def indexer(self, p: str, x: np.ndarray, qa: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """DSA lightning indexer: the keys each row keeps, as a bool mask [S, S].

        q = wq_b(qa) per head, k = LayerNorm(wk x) (eps 1e-6, weight + bias), both with
        interleaved rope on their first ``qk_rope_head_dim`` dims; score[s, t] =
        sum_h weights_proj(x)[h] * heads^-0.5 * relu(q_h . k_t * dim^-0.5); row s keeps the
        ``index_topk`` best of keys 0..s (ties toward the lower index).
        """
        w, s, r = self.w, x.shape[0], self.rope
        pre = p + "self_attn.indexer."
        q = (qa @ w[pre + "wq_b.weight"].T).reshape(s, self.idx_heads, self.idx_dim)
        q = np.concatenate([self.rotate(q[..., :r], pos), q[..., r:]], axis=-1)
        k = x @ w[pre + "wk.weight"].T
        k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
        k = k * w[pre + "k_norm.weight"] + w[pre + "k_norm.bias"]
        k = np.concatenate([self.rotate(k[:, None, :r], pos)[:, 0], k[:, r:]], axis=-1)
        head_scores = np.maximum(np.einsum("shd,td->sht", q, k) * self.idx_dim**-0.5, 0.0)
        weights = (x @ w[pre + "weights_proj.weight"].T) * self.idx_heads**-0.5
        scores = np.einsum("sh,sht->st", weights, head_scores)
        self.index_scores[p] = scores
        keep = np.zeros((s, s), dtype=bool)
        for row in range(s):
            keep[row, np.argsort(-scores[row, : row + 1], kind="stable")[: self.index_topk]] = True
        return keep

    def attention(
        self, p: str, x: np.ndarray, pos: np.ndarray, keep: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Causal MLA over all S rows (keys expanded through kv_b), DSA-masked for GLM.

        ``keep`` is the previous full layer's selection (used by "shared" layers); returns
        the output and the selection this layer used.
        """
        w, s = self.w, x.shape[0]
        if p + "self_attn.q_a_proj.weight" in w:
            qa = x @ w[p + "self_attn.q_a_proj.weight"].T
            qa = self.rmsnorm(qa, w[p + "self_attn.q_a_layernorm.weight"], 1e-6)
            q = qa @ w[p + "self_attn.q_b_proj.weight"].T
        else:
            qa = None
            q = x @ w[p + "self_attn.q_proj.weight"].T
        mask = keep
        if p + "self_attn.indexer.wq_b.weight" in w:
            assert qa is not None, "GLM always has q_a_proj"
            keep = mask = self.indexer(p, x, qa, pos)
        elif self.glm:
            assert keep is not None, f"{p}: a shared DSA layer needs a previous full layer"
            if self.shared_dense:
                mask = None
        q = q.reshape(s, self.heads, self.nope + self.rope)
        q_nope, q_rot = q[..., : self.nope], self.rotate(q[..., self.nope :], pos)
        c = x @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        latent = self.rmsnorm(c[:, : self.kv_lora], w[p + "self_attn.kv_a_layernorm.weight"], 1e-6)
        k_rot = self.rotate(c[:, None, self.kv_lora :], pos)  # [S, 1, rope]
        kv = (latent @ w[p + "self_attn.kv_b_proj.weight"].T).reshape(
            s, self.heads, self.nope + self.v_dim
        )
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        scores = np.einsum("shd,thd->hst", q_nope, k_nope)
        scores += np.einsum("shd,td->hst", q_rot, k_rot[:, 0])
        scores *= self.scaling
        allowed = np.tril(np.ones((s, s), dtype=bool))
        if mask is not None:
            allowed &= mask
        scores = np.where(allowed[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        out = np.einsum("hst,thd->shd", probs, v).reshape(s, self.heads * self.v_dim)
        return out @ w[p + "self_attn.o_proj.weight"].T, keep

    def mlp(self, p: str, x: np.ndarray) -> np.ndarray:
        """down(silu(gate x) * up x)."""
        g = x @ self.w[p + "gate_proj.weight"].T
        u = x @ self.w[p + "up_proj.weight"].T
        return (g / (1 + np.exp(-g)) * u) @ self.w[p + "down_proj.weight"].T

    def moe(self, p: str, h: np.ndarray) -> np.ndarray:
        """noaux_tc routing, routed experts and shared experts."""
        c = self.cfg
        n_exp, k = int(c["n_routed_experts"]), int(c["num_experts_per_tok"])
        ng, tg = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
        scores = 1 / (1 + np.exp(-(h @ self.w[p + "mlp.gate.weight"].T)))
        choice = scores + self.w[p + "mlp.gate.e_score_correction_bias"]
        out = self.mlp(p + "mlp.shared_experts.", h)
        for row in range(h.shape[0]):
            cr = choice[row].copy()
            groups = cr.reshape(ng, n_exp // ng)
            gscore = np.sort(groups, axis=-1)[:, -2:].sum(-1)
            keep = np.argsort(-gscore, kind="stable")[:tg]
            mask = np.zeros(ng, dtype=bool)
            mask[keep] = True
            cr[~np.repeat(mask, n_exp // ng)] = -np.inf
            ids = np.argsort(-cr, kind="stable")[:k]
            wts = scores[row, ids]
            if c.get("norm_topk_prob"):
                wts = wts / (wts.sum() + 1e-20)
            wts = wts * float(c["routed_scaling_factor"])
            for e, wt in zip(ids, wts, strict=True):
                out[row] += wt * self.mlp(f"{p}mlp.experts.{e}.", h[row : row + 1])[0]
        return out

    def layer(
        self, p: str, x: np.ndarray, pos: np.ndarray, keep: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One decoder layer (dense or MoE, decided by the tensors present).

        Returns the new residual stream and the DSA selection the layer used (GLM).
        """
        normed = self.rmsnorm(x, self.w[p + "input_layernorm.weight"], self.eps)
        attn, keep = self.attention(p, normed, pos, keep)
        x = x + attn
        h = self.rmsnorm(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
        mlp = self.moe(p, h) if p + "mlp.gate.weight" in self.w else self.mlp(p + "mlp.", h)
        return x + mlp, keep

    def topk_rows(self, keep: np.ndarray) -> np.ndarray:
        """A selection mask [S, S] in the golden form: I32 [S, index_topk], -1 padded."""
        out = np.full((keep.shape[0], self.index_topk), -1, dtype=np.int32)
        for row in range(keep.shape[0]):
            ids = np.nonzero(keep[row])[0]
            out[row, : len(ids)] = ids
        return out

    def forward(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """Main model: (logits [S, V], pre-norm hidden [S, H], {full layer: selection})."""
        pos = np.arange(len(ids))
        x = self.embed[ids]
        keep: np.ndarray | None = None
        selections: dict[int, np.ndarray] = {}
        for layer_idx in range(self.n_layers):
            p = f"model.layers.{layer_idx}."
            if self.glm:
                full = p + "self_attn.indexer.wq_b.weight" in self.w
                assert full == (self.indexer_types[layer_idx] == "full"), f"{p}: indexer_types"
            x, keep = self.layer(p, x, pos, keep)
            if self.glm and self.indexer_types[layer_idx] == "full":
                assert keep is not None
                selections[layer_idx] = self.topk_rows(keep)
        normed = self.rmsnorm(x, self.w["model.norm.weight"], self.eps)
        return normed @ self.head.T, x, selections

    def mtp(
        self, tokens: np.ndarray, carried: np.ndarray, pos: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """MTP layer over rows: (raw block output z, shared_head.norm(z), DSA selection)."""
        p = f"model.layers.{self.n_layers}."
        e = self.rmsnorm(self.embed[tokens], self.w[p + "enorm.weight"], self.eps)
        h = self.rmsnorm(carried, self.w[p + "hnorm.weight"], self.eps)
        x = np.concatenate([e, h], axis=-1) @ self.w[p + "eh_proj.weight"].T
        z, keep = self.layer(p, x, pos)
        return z, self.rmsnorm(z, self.w[p + "shared_head.norm.weight"], self.eps), keep

    def compare(self, golden: dict[str, np.ndarray]) -> dict[str, float]:
        """Max |reference - golden| for every golden float tensor (ids, selections must match).

        Every ``dsa_topk_{L}`` / ``mtp_dsa_topk`` golden present must be selected exactly.
        """
        prompt, greedy_ids = golden["prompt_ids"], golden["greedy_ids"]
        t = len(prompt)
        logits, hidden, _ = self.forward(prompt)
        full_logits, _, selections = self.forward(np.concatenate([prompt, greedy_ids[:-1]]))
        for layer, sel in selections.items():
            if f"dsa_topk_{layer}" in golden:
                assert np.array_equal(sel, golden[f"dsa_topk_{layer}"]), f"numpy dsa_topk_{layer}"
        gl = full_logits[t - 1 : t - 1 + len(greedy_ids)]
        assert np.array_equal(gl.argmax(-1), greedy_ids), "numpy greedy ids differ"
        hn = self.rmsnorm(hidden, self.w["model.norm.weight"], self.eps)
        diffs = {
            "logits": float(np.abs(logits - golden["logits"]).max()),
            "hidden": float(np.abs(hidden - golden["hidden"]).max()),
            "greedy_logits": float(np.abs(gl - golden["greedy_logits"]).max()),
        }
        tokens = np.concatenate([prompt[1:], greedy_ids[:1]])
        pos = np.arange(1, t + 1)
        z, zn, mtp_keep = self.mtp(tokens, hn, pos)
        if "mtp_dsa_topk" in golden:
            assert mtp_keep is not None
            sel = self.topk_rows(mtp_keep)[: t - 1]
            assert np.array_equal(sel, golden["mtp_dsa_topk"]), "numpy mtp_dsa_topk differs"
        mtp_logits = zn[: t - 1] @ self.head.T
        diffs["mtp_logits"] = float(np.abs(mtp_logits - golden["mtp_logits"]).max())
        for raw, key in ((False, "mtp_chain"), (True, "mtp_chain_raw")):
            toks, carry, ps, zz, zzn = tokens, hn, pos, z, zn
            chain_logits = []
            for depth in range(len(golden[key + "_ids"])):
                if depth > 0:
                    zz, zzn, _ = self.mtp(toks, carry, ps)
                lg = zzn[-1] @ self.head.T
                d = int(lg.argmax())
                assert d == int(golden[key + "_ids"][depth]), f"numpy {key} id differs"
                chain_logits.append(lg)
                toks = np.append(toks, d)
                carry = np.concatenate([carry, (zz if raw else zzn)[-1:]])
                ps = np.append(ps, ps[-1] + 1)
            diffs[key + "_logits"] = float(
                np.abs(np.stack(chain_logits) - golden[key + "_logits"]).max()
            )
        return diffs
