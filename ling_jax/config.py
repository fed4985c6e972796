"""`LingConfig`: every field of a Ling-3 (BailingMoeV3) `config.json`, validated, plus the layer schedule.

The field names are the Hugging Face ones (ARCHITECTURE.md §1) so a preset in `configs/` is a plain
HF `config.json`. A few runtime options that are not part of the checkpoint (which kernel to use,
whether to apply the SwiGLU clamps) live here too, so one hashable object is the only static
argument the jitted model functions need.

The layer schedule (§1.2) is exposed twice: `layer_kinds` (one `(mixer, ffn)` pair per main
layer) and `segments` (the same layers cut into homogeneous runs and one repeating block of
groups), which is how params and caches are stacked so that the stack compiles once per kind.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

ARCHITECTURE = "BailingMoeV3ForCausalLM"
PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"

Mixer = Literal["kda", "mla"]
Ffn = Literal["dense", "moe"]
# Implementation names (`ling_jax.kernels.select` resolves them; "auto": the fastest exact one there):
KDA_IMPLS = ("auto", "reference", "chunked", "pallas")  # = ling_jax.ops.kda.api.IMPLS (tested)
MOE_IMPLS = ("auto", "ragged", "dense", "gather", "gemv", "aligned", "mgpu", "gmm")  # = ling_jax.ops.moe.IMPLS (tested)
# the decode step's attention ops: XLA, or one Pallas kernel each
DECODE_IMPLS = ("auto", "xla", "pallas")
# the MLA attention of prefill and training: the materialised XLA softmax or the fused flash kernels
ATTENTION_IMPLS = ("auto", "xla", "pallas")
# the widths the Pallas kernels need as powers of two, with their least value (Triton tiles): the
# decode step's MLA and KDA kernels and the fused attention (= each kernel's `supported`, tested)
PALLAS_WIDTHS = {"mla": (("kv_lora_rank", 1), ("qk_rope_head_dim", 1)), "kda": (("head_dim", 16),),
                 "attention": (("qk_nope_head_dim", 16), ("qk_rope_head_dim", 16), ("v_head_dim", 16))}


class ConfigError(ValueError):
    """A config.json that ling-jax cannot run; the message names the offending field."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Block-FP8 checkpoint format (`quantization_config`, ARCHITECTURE.md §4)."""

    block_size: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"
    exclusions: tuple[str, ...] = ()
    scale_fmt: str | None = None

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> QuantConfig:
        method = d.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"quantization_config.quant_method={method!r}: only block 'fp8' is supported"
            )
        fmt = d.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"quantization_config.fmt={fmt!r}: only 'e4m3' is supported")
        block = d.get("weight_block_size") or [128, 128]
        if not isinstance(block, list | tuple) or len(block) != 2 or not all(is_int(b) and b > 0 for b in block):
            raise ConfigError(f"quantization_config.weight_block_size={block!r} must be [rows, cols]")
        excl: list[str] = []
        for key in ("modules_to_not_convert", "ignore", "ignored_layers"):
            names = d.get(key) or []
            if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
                raise ConfigError(f"quantization_config.{key}={names!r} must be a list of module names")
            excl += list(names)
        return cls(
            block_size=(int(block[0]), int(block[1])),
            fmt=fmt,
            exclusions=tuple(excl),
            scale_fmt=d.get("scale_fmt"),
        )

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": self.fmt,
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block_size),
            "modules_to_not_convert": list(self.exclusions),
        }
        if self.scale_fmt is not None:
            out["scale_fmt"] = self.scale_fmt
        return out

    def excludes(self, module: str) -> bool:
        """Whether `module` (a dotted HF module path) is listed as not converted.

        Entries are dotted suffixes matched segment-wise: `gate` matches `model.layers.3.mlp.gate`
        but not `...gate_proj`, and `5.attention.g_proj` only the g_proj of layer 5.
        """
        parts = module.split(".")
        for entry in self.exclusions:
            e = entry.split(".")
            if len(e) <= len(parts) and parts[-len(e) :] == e:
                return True
        return False


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of the layer stack whose params are stacked along leading axes.

    `kind == "run"`: `length` consecutive layers of one `(mixer, ffn)` kind; params carry `[length]`.
    `kind == "groups"`: `length` repeats of `kda_per_group` (kda, moe) layers then one (mla, moe)
    layer; the KDA params carry `[length, kda_per_group]`, the MLA params `[length]`.
    """

    kind: Literal["run", "groups"]
    first_layer: int
    length: int
    mixer: Mixer = "mla"
    ffn: Ffn = "moe"
    kda_per_group: int = 0

    @property
    def num_layers(self) -> int:
        return self.length if self.kind == "run" else self.length * (self.kda_per_group + 1)


def _tuple_or_none(v: Any) -> tuple | None:
    return None if v is None else tuple(v)


def is_int(v: Any) -> bool:
    """An int and not a bool (JSON's integers)."""
    return isinstance(v, int) and not isinstance(v, bool)


# what a scalar field's declared type admits: (test, description for the error)
_SCALAR_KINDS: dict[str, tuple[Any, str]] = {
    "int": (is_int, "int (an integer)"),
    "float": (lambda v: is_int(v) or isinstance(v, float), "float (a number)"),
    "bool": (lambda v: isinstance(v, bool), "bool (true or false)"),
    "str": (lambda v: isinstance(v, str), "str (a string)"),
}


def kind_error(name: str, annotation: str, v: Any) -> str | None:
    """Why field `name` = `v` is not of the scalar kind its dataclass annotation declares ("int",
    "float | None", ...), or None (also for annotations that are not scalar kinds)."""
    kinds = annotation.split(" | ")
    test, what = _SCALAR_KINDS.get(kinds[0], (None, ""))
    if test is None or (v is None and "None" in kinds) or test(v):
        return None
    return f"{name}={v!r}: must be {what}" + (" or null" if "None" in kinds else "")
# read only when the model has MoE layers
MOE_FIELDS = ("moe_intermediate_size", "moe_shared_expert_intermediate_size", "num_experts_per_tok",
              "num_shared_experts", "n_group", "topk_group", "routed_scaling_factor")


@dataclasses.dataclass(frozen=True)
class LingConfig:
    """A Ling-3 model: HF `config.json` fields (ARCHITECTURE.md §1) plus runtime options."""

    vocab_size: int = 157184
    hidden_size: int = 1536
    intermediate_size: int = 4608
    num_hidden_layers: int = 24
    layer_group_size: int = 4
    first_k_dense_replace: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float | None = -5.0
    q_lora_rank: int | None = 256
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    gated_attention_proj_granularity_type: str = "head_wise"
    rope_theta: float = 6_000_000.0
    rope_interleave: bool = True
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    num_experts: int | None = 128
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 512
    moe_shared_expert_intermediate_size: int = 512
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    num_nextn_predict_layers: int = 1
    mtp_loss_scaling_factor: float = 0.0
    expert_swiglu_limit_list: tuple[float | None, ...] | None = None
    share_expert_swiglu_limit_list: tuple[float | None, ...] | None = None
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    initializer_range: float = 0.02
    # storage format of the checkpoint's weights: not part of the function the model computes, so
    # not compared (an FP8 and a BF16 checkpoint of one model share their compiled functions)
    quantization: QuantConfig | None = dataclasses.field(default=None, compare=False)
    # --- runtime options (not in config.json) ---
    kda_impl: str = "auto"
    moe_impl: str = "auto"
    decode_impl: str = "auto"
    attention_impl: str = "auto"
    swiglu_clamp: bool = True
    # the original JSON, kept to write it back on export (not compared, not hashed)
    hf_json: str = dataclasses.field(default="", compare=False, repr=False)

    def pallas_widths(self, kernel: Literal["mla", "kda", "attention"]) -> bool:
        """Whether the config's widths are what the Pallas `kernel` takes (`PALLAS_WIDTHS`)."""
        return all((v := getattr(self, name)) >= least and v & (v - 1) == 0 for name, least in PALLAS_WIDTHS[kernel])

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf(cls, path_or_dict: str | Path | Mapping[str, Any], **options: Any) -> LingConfig:
        """Reads an HF `config.json` (a directory holding one, the file, or its dict)."""
        if isinstance(path_or_dict, Mapping):
            d = dict(path_or_dict)
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            if not p.is_file():
                raise ConfigError(f"no config.json at {p}")
            try:
                d = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}: not valid JSON ({e})") from e
        if not isinstance(d, Mapping):
            raise ConfigError(f"config.json holds a JSON {type(d).__name__}, not an object of fields")
        archs = d.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ConfigError(
                f"architectures={archs!r}: ling-jax runs {ARCHITECTURE} (Ling-3) only; "
                f"model_type {d.get('model_type')!r} alone does not identify Ling-3"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d['hidden_act']!r}: only 'silu' is supported")
        for flag in ("use_qkv_bias", "use_bias"):
            if d.get(flag):
                raise ConfigError(f"{flag}=true: biased projections are not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in names}
        for key in ("rope_scaling", "rope_parameters"):  # transformers v5 names it rope_parameters
            scaling = d.get(key)
            if scaling is not None and not isinstance(scaling, Mapping):
                raise ConfigError(f"{key}={scaling!r}: must be null or an object")
            if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
                raise ConfigError(f"{key}={scaling!r}: only default RoPE is supported")
            theta = (scaling or {}).get("rope_theta")  # v5 keeps the base there
            if theta is not None and kw.setdefault("rope_theta", theta) != theta:
                raise ConfigError(f"{key}.rope_theta={theta!r} != rope_theta={kw['rope_theta']!r}")
        eos = d.get("eos_token_id")
        kw["eos_token_id"] = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        for k in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            kw[k] = _tuple_or_none(d.get(k))
        if "num_shared_experts" in d and d["num_shared_experts"] is None:
            kw["num_shared_experts"] = 0
        q = d.get("quantization_config")
        if q is not None and not isinstance(q, Mapping):
            raise ConfigError(f"quantization_config={q!r}: must be null or an object")
        kw["quantization"] = QuantConfig.from_hf(q) if q else None
        kw["hf_json"] = json.dumps(d, sort_keys=True)
        kw.update(options)
        nope, rope = d.get("qk_nope_head_dim", cls.qk_nope_head_dim), d.get("qk_rope_head_dim", cls.qk_rope_head_dim)
        if d.get("qk_head_dim") is not None and is_int(nope) and is_int(rope) and d["qk_head_dim"] != nope + rope:
            raise ConfigError(f"qk_head_dim={d['qk_head_dim']} != qk_nope_head_dim + qk_rope_head_dim = {nope + rope}")
        return cls(**kw)

    @classmethod
    def preset(cls, name: str, **options: Any) -> LingConfig:
        """Loads `configs/<name>.json` (`ling-3.0-tiny`, `ling-3.0-flash`, `ling-3.1-flash`, `debug`)."""
        p = PRESETS_DIR / f"{name}.json"
        if not p.is_file():
            known = sorted(x.stem for x in PRESETS_DIR.glob("*.json"))
            raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(known)}")
        return cls.from_hf(p, **options)

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict of this config (original keys kept, our fields updated)."""
        d: dict[str, Any] = json.loads(self.hf_json) if self.hf_json else {}
        runtime = {"kda_impl", "moe_impl", "decode_impl", "attention_impl", "swiglu_clamp", "hf_json", "quantization",
                   "eos_token_id"}
        for f in dataclasses.fields(self):
            if f.name not in runtime:
                v = getattr(self, f.name)
                d[f.name] = list(v) if isinstance(v, tuple) else v
        if self.eos_token_id:
            d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        else:
            d.pop("eos_token_id", None)
        for key in ("rope_scaling", "rope_parameters"):  # a v5 base kept there follows ours
            if isinstance(d.get(key), dict) and d[key].get("rope_theta") is not None:
                d[key] = {**d[key], "rope_theta": self.rope_theta}
        d["architectures"] = [ARCHITECTURE]
        d.setdefault("model_type", "bailing_hybrid")
        d["qk_head_dim"] = self.qk_head_dim
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_hf()
        else:
            d.pop("quantization_config", None)
        return d

    @property
    def _any_moe(self) -> bool:
        """Whether any layer, the MTP layers included, is MoE (then the MoE fields are read)."""
        mtp = self.num_nextn_predict_layers
        return self.uses_moe or (self.num_experts is not None and is_int(mtp) and mtp > 0)

    def _unused_fields(self) -> set[str]:
        """Fields this config never reads (its MoE sizes without MoE layers, ...): they may be null."""
        unused = set()
        if not self._any_moe:
            unused |= set(MOE_FIELDS)
        if not self.num_shared_experts:
            unused.add("moe_shared_expert_intermediate_size")
        if self.num_experts is not None and self.first_k_dense_replace == 0:
            unused.add("intermediate_size")
        return unused

    def _check_types(self) -> None:
        """ConfigError naming the first field whose value is not of its declared kind (a JSON null or
        string where a number belongs...); fields the config never reads may be null."""
        for f in dataclasses.fields(self):
            kind, v = str(f.type), getattr(self, f.name)
            if v is None and f.name in self._unused_fields():
                continue
            if kind == "int" and isinstance(v, float) and v.is_integer():  # 32768.0: an int
                object.__setattr__(self, f.name, v := int(v))
            if kind == "bool" and is_int(v) and v in (0, 1):
                object.__setattr__(self, f.name, v := bool(v))
            why = kind_error(f.name, kind, v)
            if why:
                raise ConfigError(why)

    def __post_init__(self) -> None:
        for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list", "eos_token_id"):
            v = getattr(self, name)
            if isinstance(v, list):  # keep the config hashable (it is a static jit argument)
                object.__setattr__(self, name, tuple(v))
        eos = self.eos_token_id  # HF writes one id as a plain int
        if eos is None or isinstance(eos, int):
            object.__setattr__(self, "eos_token_id", () if eos is None else (eos,))
        if not all(map(is_int, self.eos_token_id)):
            raise ConfigError(f"eos_token_id={self.eos_token_id!r}: must be a token id or a list of them")
        # the fields the schedule reads first, then every scalar field's kind
        for f in ("num_hidden_layers", "first_k_dense_replace"):
            why = kind_error(f, "int", getattr(self, f))
            if why:
                raise ConfigError(why)
        self._check_types()

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"{field}={getattr(self, field)!r}: {why}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "layer_group_size", "short_conv_kernel_size"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f,
                 "must be a positive integer")
        need(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
             f"must equal num_attention_heads={self.num_attention_heads} (no GQA in Ling-3)")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        need(self.rope_interleave, "rope_interleave", "only interleaved RoPE is defined for Ling-3")
        need(self.gated_attention_proj_granularity_type in ("head_wise", "element_wise"),
             "gated_attention_proj_granularity_type", "must be 'head_wise' or 'element_wise'")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank",
             "must be null or positive")
        need(self.kda_lower_bound is None or self.kda_lower_bound < 0, "kda_lower_bound",
             "must be negative (log-space lower bound of the decay)")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        need(self.kda_impl in KDA_IMPLS, "kda_impl", f"must be one of {KDA_IMPLS}")
        need(self.moe_impl in MOE_IMPLS, "moe_impl", f"must be one of {MOE_IMPLS}")
        need(self.decode_impl in DECODE_IMPLS, "decode_impl", f"must be one of {DECODE_IMPLS}")
        need(self.attention_impl in ATTENTION_IMPLS, "attention_impl", f"must be one of {ATTENTION_IMPLS}")
        need(self.attention_impl != "pallas" or self.pallas_widths("attention"), "attention_impl",
             "'pallas' needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim powers of two >= 16")
        if self.decode_impl == "pallas":  # the kernels' tiles are powers of two (Triton), KDA's >= 16
            for kernel in ("mla", "kda"):
                for name, least in PALLAS_WIDTHS[kernel]:
                    need(self.pallas_widths(kernel), name,
                         f"must be a power of two >= {least} for decode_impl='pallas'")
        if self._any_moe:
            e = self.num_experts
            need(e is not None and e > 0, "num_experts", "must be positive")
            need(self.n_group > 0 and e % self.n_group == 0, "n_group",
                 f"num_experts={e} must be divisible by n_group")
            need(e // self.n_group >= 2, "n_group",
                 "each expert group needs at least 2 experts (group score = sum of its top 2)")
            need(0 < self.topk_group <= self.n_group, "topk_group", f"must be in [1, n_group={self.n_group}]")
            need(0 < self.num_experts_per_tok <= self.topk_group * (e // self.n_group),
                 "num_experts_per_tok", "must be positive and at most topk_group * experts per group")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
            need(self.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        """P = H * Dh, the width of the KDA q/k/v/f/g projections."""
        return self.num_attention_heads * self.head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_shared_expert_intermediate_size * self.num_shared_experts if self.num_shared_experts else 0

    @property
    def uses_moe(self) -> bool:
        return self.num_experts is not None and self.first_k_dense_replace < self.num_hidden_layers

    # ------------------------------------------------------------------ schedule (§1.2)
    def mixer_of(self, i: int) -> Mixer:
        g, n = self.layer_group_size, self.num_hidden_layers
        if i >= n:  # MTP layers
            return "mla"
        return "mla" if (i + 1) % g == 0 or i >= (n // g) * g else "kda"

    def ffn_of(self, i: int) -> Ffn:
        if i >= self.num_hidden_layers:
            return "moe" if self.num_experts is not None else "dense"
        return "dense" if i < self.first_k_dense_replace or self.num_experts is None else "moe"

    @property
    def layer_kinds(self) -> tuple[tuple[Mixer, Ffn], ...]:
        return tuple((self.mixer_of(i), self.ffn_of(i)) for i in range(self.num_hidden_layers))

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The main layers cut into stacked segments: runs, then repeating groups, then runs.

        Groups of `layer_group_size` layers that have the canonical pattern (G-1 × (kda, moe), then
        (mla, moe)) from some group on up to the last complete group become one `groups`
        segment (one `lax.scan` over groups); every other layer joins a `run` of consecutive
        layers of one kind.
        """
        kinds = self.layer_kinds
        g = self.layer_group_size
        n_full = self.num_hidden_layers // g
        canonical = (("kda", "moe"),) * (g - 1) + (("mla", "moe"),)
        first_regular = n_full
        while first_regular > 0 and kinds[(first_regular - 1) * g : first_regular * g] == canonical:
            first_regular -= 1
        segs: list[Segment] = []

        def add_runs(lo: int, hi: int) -> None:
            i = lo
            while i < hi:
                j = i
                while j < hi and kinds[j] == kinds[i]:
                    j += 1
                segs.append(Segment("run", i, j - i, mixer=kinds[i][0], ffn=kinds[i][1]))
                i = j

        add_runs(0, first_regular * g)
        if n_full > first_regular:
            segs.append(Segment("groups", first_regular * g, n_full - first_regular,
                                kda_per_group=g - 1))
        add_runs(n_full * g, self.num_hidden_layers)
        return tuple(segs)

    def swiglu_limits(self, i: int) -> tuple[float, float]:
        """(routed, shared) SwiGLU clamp of main layer i; 0 means no clamp (§2.6)."""

        def pick(lst: tuple[float | None, ...] | None) -> float:
            if not self.swiglu_clamp or lst is None or i >= len(lst) or not lst[i]:
                return 0.0
            return float(lst[i])

        return pick(self.expert_swiglu_limit_list), pick(self.share_expert_swiglu_limit_list)
