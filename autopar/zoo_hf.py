"""Any transformers architecture from its config class: shrunk to a tiny model, or at full size.

:func:`architectures` lists the model classes of transformers' auto mappings for the tasks
autopar trains (causal LM, masked LM, seq2seq, image classification, audio, contrastive);
:func:`build` makes one of them from its config class with random weights (nothing is
downloaded) and example inputs with labels, so that ``model(**inputs)`` returns the loss::

    arch = next(a for a in architectures() if a.model_type == "llama")
    model, inputs = build(arch)                       # 2 layers, hidden 32, batch 4
    model, inputs = build(arch, size="full", device="meta")   # the config class's own sizes

``size="tiny"`` shrinks the config: layer counts to 2 (per-layer lists keep one layer of each
kind where the first two miss one), widths to a few dozen, heads to 4 (2
key/value heads), experts to 4, vocabularies to 256, conv channels and stage widths by a common
factor; nested configs (text/vision/audio) alike. A config whose checks refuse the tiny sizes,
or a class without a known input signature, raises :class:`BuildError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
from torch import nn

from autopar.core.errors import AutoparError
from autopar.passes.capture.dtype import cast_floating

TASKS = {  # task -> transformers auto-mapping name
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "contrastive": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}


class BuildError(AutoparError, ValueError):
    """An architecture cannot be built from its config class, or has no known example inputs."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model class of an auto mapping: ``task``, the config's ``model_type``, class name."""

    task: str
    model_type: str
    class_name: str

    @property
    def name(self) -> str:
        return f"{self.task}/{self.class_name}"


def architectures(tasks=tuple(TASKS)) -> list[Architecture]:
    """The model classes of the auto mappings of ``tasks``, each class once (first task wins)."""
    from transformers.models.auto import modeling_auto

    out, seen = [], set()
    for task in tasks:
        for model_type, names in getattr(modeling_auto, TASKS[task]).items():
            for class_name in (names,) if isinstance(names, str) else names:
                if class_name not in seen:
                    seen.add(class_name)
                    out.append(Architecture(task, model_type, class_name))
    return out


# ----------------------------------------------------------------------------- tiny configs

TINY_LAYERS = 2
TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM = 4, 2, 16
TINY_HIDDEN = TINY_HEADS * TINY_HEAD_DIM
TINY_FFN = 2 * TINY_HIDDEN
TINY_VOCAB = 256
TINY_EXPERTS, TINY_TOP_K = 4, 2
CHANNEL_FACTOR = 8  # conv channels and stage widths (lists) are divided by it

_LAYERS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
           "num_encoder_layers", "num_decoder_layers", "max_window_layers", "num_self_attends_per_block",
           "speech_encoder_layers", "conf_num_hidden_layers", "num_spatial_layers"}
_HIDDEN = {"hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "dim", "projection_dim",
           "word_embed_proj_dim", "encoder_hidden_size", "output_hidden_size", "d_latents",
           "cross_attention_hidden_size", "true_hidden_size", "intra_bottleneck_size"}
_SMALL_HIDDEN = {"embedding_size", "classifier_proj_size", "proj_codevector_dim", "codevector_dim",
                 "xvector_output_dim", "kv_lora_rank", "q_lora_rank"}  # -> TINY_HIDDEN // 2
_HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
          "decoder_attention_heads", "attention_heads", "index_n_heads", "linear_num_value_heads"}
_KV_HEADS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "linear_num_key_heads", "num_query_groups"}
_HEAD_DIM = {"head_dim", "d_kv", "attention_head_size", "dim_head", "kv_channels", "v_head_dim",
             "qk_nope_head_dim", "index_head_dim", "linear_key_head_dim", "linear_value_head_dim"}
_HALF_HEAD_DIM = {"qk_rope_head_dim", "rotary_dim"}
_FFN = {"intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
        "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size", "dim_ff",
        "decoder_intermediate_size", "intermediate_size_mlp", "feed_forward_size",
        "dense_intermediate_size", "expert_ffn_hidden_size", "speech_encoder_intermediate_size"}
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "moe_topk", "top_k"}
_VOCABS = {"vocab_size"}
_CHANNEL_LISTS = {"hidden_sizes", "embed_dims", "conv_dim", "neck_hidden_sizes", "stem_channels",
                  "stage_in_channels", "stage_mid_channels", "stage_out_channels", "tdnn_dim",
                  "sscp_conv_channel_size"}
_DEPTH_LISTS = {"depths", "depth", "stage_num_blocks", "stage_numb_of_layers", "block_repeats"}
_CAPS = ((_LAYERS, TINY_LAYERS), (_HIDDEN, TINY_HIDDEN), (_SMALL_HIDDEN, TINY_HIDDEN // 2),
         (_HEADS, TINY_HEADS), (_HEAD_DIM, TINY_HEAD_DIM), (_HALF_HEAD_DIM, TINY_HEAD_DIM // 2),
         (_FFN, TINY_FFN), (_EXPERTS, TINY_EXPERTS), (_TOP_K, TINY_TOP_K), (_VOCABS, TINY_VOCAB))
_ZERO = ("dropout", "drop_prob", "pdrop", "drop_path_rate", "layerdrop", "mask_time_prob",
         "mask_feature_prob", "drop_rate")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids(value) -> list[int]:
    return [value] if _is_int(value) else [v for v in value if _is_int(v)] if isinstance(value, list) else []


def _dropout(key: str, value) -> bool:
    return isinstance(value, float) and any(z in key for z in _ZERO)


def _tiny_value(key: str, value, old: dict, ids: dict):
    """The tiny value of one config field (``old``: the whole config dict; ``ids``: special
    token ids seen so far, remapped below the tiny vocabulary)."""
    if value is None and any(old.get(k, 0) is None for k in _VOCABS):
        # a config class that leaves its vocabulary to the checkpoints (ESM) leaves their pad
        # and mask ids too: a tiny vocabulary, and fresh ids at its top
        if key in _VOCABS:
            return TINY_VOCAB
        if key in ("pad_token_id", "mask_token_id"):
            return ids.setdefault(key, TINY_VOCAB - 1 - len(ids))
    if value is None and key in _KV_HEADS:  # left unset (Nemotron's model divides by it): no grouping
        return next((min(old[k], TINY_HEADS) for k in sorted(_HEADS) if _is_int(old.get(k))), None)
    if _is_int(value):
        if key in _KV_HEADS:
            heads = next((old[k] for k in sorted(_HEADS) if _is_int(old.get(k))), value)
            return min(value, TINY_HEADS if value >= heads else TINY_KV_HEADS)
        cap = next((cap for keys, cap in _CAPS if key in keys), None)
        if cap is not None:
            return min(value, cap)
    if key.endswith(("token_id", "token_index", "token_ids")) and _ids(value):
        remap = [ids.setdefault(v, TINY_VOCAB - 1 - len(ids)) if v >= TINY_VOCAB else v for v in _ids(value)]
        return remap[0] if _is_int(value) else remap
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        if key in _CHANNEL_LISTS:
            return [max(8, v // CHANNEL_FACTOR) for v in value]
        if key in _DEPTH_LISTS:
            return [min(v, 1) for v in value]
        if key in _HEADS:  # per stage; powers of two divide the tiny stage widths
            return [min(TINY_HEADS, 1 << (v.bit_length() - 1)) if v > 0 else v for v in value]
    if _dropout(key, value):
        return 0.0
    return value


def tiny_config(config, *, every_kind: bool = True):
    """A copy of ``config`` with tiny sizes (see the module docstring); ``config`` is kept.
    ``every_kind``: per-layer lists keep one layer of each kind (:func:`_tiny_layers`)."""
    return type(config)(**_tiny_kwargs(config, {}, every_kind))


def _tiny_kwargs(config, ids: dict, every_kind: bool) -> dict:
    """The fields of ``config`` that shrink, and every dropout-like one (at 0: a nested config's
    dict takes its class's default for a field it omits, Parakeet's ``layerdrop=0.1`` in Canary)."""
    old = config.to_dict()
    layers = next((old[k] for k in sorted(_LAYERS) if _is_int(old.get(k))), None)
    if any(isinstance(old.get(k), list) and len(old[k]) == layers for k in _DEPTH_LISTS):
        layers = None  # a count of stages (Swinv2's num_layers = len(depths)): their lists stay whole
    params = inspect.signature(type(config).__init__).parameters
    kwargs = {}
    for key, value in old.items():
        if key not in params or key in ("transformers_version", "architectures"):
            continue
        sub = getattr(config, key, None) if key in getattr(config, "sub_configs", {}) else None
        if sub is not None and hasattr(sub, "to_dict"):
            kind = {"model_type": sub.model_type} if getattr(sub, "model_type", "") else {}
            kwargs[key] = {**kind, **_tiny_kwargs(sub, ids, every_kind)}  # some classes read a dict's model_type
            continue
        new = _tiny_value(key, value, old, ids)
        if isinstance(value, list) and layers and len(value) == layers and new is value:
            new = _tiny_layers(value) if every_kind else value[:TINY_LAYERS]  # per-layer lists (layer_types, ...) follow the layer count
        if new != value or new == 0.0 and _dropout(key, value):
            kwargs[key] = new
    return kwargs


def _tiny_layers(per_layer: list) -> list:
    """A per-layer list for :data:`TINY_LAYERS` layers: its first ones, or where those miss a
    kind of layer (a hybrid's attention after three linear layers), one of each kind in order."""
    try:
        kinds = list(dict.fromkeys(per_layer))
    except TypeError:  # unhashable entries
        return per_layer[:TINY_LAYERS]
    if len(kinds) <= TINY_LAYERS and set(per_layer[:TINY_LAYERS]) != set(kinds):
        return (kinds * TINY_LAYERS)[:TINY_LAYERS]
    return per_layer[:TINY_LAYERS]


# ----------------------------------------------------------------------------- models and inputs


def config_of(arch: Architecture, size: str = "tiny", *, every_kind: bool = True):
    """The config of ``arch``: its config class's defaults (``"full"``) or shrunk (``"tiny"``;
    ``every_kind``: see :func:`tiny_config`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[arch.model_type]()
        if size == "tiny":
            config = tiny_config(config, every_kind=every_kind)
    except Exception as exc:
        raise BuildError(f"{arch.name}: its config class refuses the {size} sizes: {type(exc).__name__}: "
                         f"{_first_line(exc)}") from exc
    for sub in (config, config.get_text_config()):
        sub.use_cache = False
        if sub.is_encoder_decoder:
            # the config class leaves them to the checkpoints (T5's start decoding at the pad
            # token; an EncoderDecoder pair's are its decoder's)
            decoder = getattr(sub, "decoder", None)
            for key in ("pad_token_id", "decoder_start_token_id"):
                if getattr(sub, key, None) is None:
                    own = getattr(decoder, key, None)
                    setattr(sub, key, own if own is not None else getattr(sub, "pad_token_id", None))
    return config


def without_randomness(config):
    """``config`` (changed in place and returned) with every dropout-like probability at 0, its
    nested configs' too: what the tiny configs do. SpecAugment's masks (``mask_time_prob``) are
    drawn with numpy from values in forward, which torch.export cannot trace."""
    subs = getattr(config, "sub_configs", None) or {}
    for key, value in config.to_dict().items():
        if key in subs:  # read only these: a per-layer attribute (Dots3's heads) refuses a global read
            sub = getattr(config, key, None)
            if hasattr(sub, "to_dict"):
                without_randomness(sub)
        elif _dropout(key, value):
            setattr(config, key, 0.0)
    return config


def is_moe(config) -> bool:
    """Whether a config (or one nested in it) routes tokens to several experts."""
    return _experts(config.to_dict()) > 1


EP_EXPERTS, EP_FFN, EP_BATCH, EP_SEQ = 8, 512, 8, 64  # tiny MoE sizes at which 2 ranks plan expert parallelism


def with_experts(config, *, experts: int = EP_EXPERTS, ffn: int = EP_FFN):
    """``config`` (changed in place and returned) with ``experts`` routed experts of ``ffn`` hidden
    features each (the feed-forward sizes of its dense layers too, where one key names both)."""
    for key in _EXPERTS:
        if _is_int(getattr(config, key, None)):
            setattr(config, key, experts)
    for key in ("intermediate_size", "moe_intermediate_size"):
        if _is_int(getattr(config, key, None)):
            setattr(config, key, ffn)
    return config


def _experts(config: dict) -> int:
    counts = [v for k, v in config.items() if k in _EXPERTS and _is_int(v)]
    counts += [_experts(v) for v in config.values() if isinstance(v, dict)]
    return max(counts, default=0)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def build(arch: Architecture, *, size: str = "tiny", batch: int = 4, seq: int = 16, device=None,
          seed: int = 0, config=None, experts: bool = False) -> tuple[nn.Module, dict]:
    """``(model, inputs)`` for ``arch``: a model in training mode with random weights (seeded,
    the caller's RNG kept) and keyword inputs with labels, so that ``model(**inputs)`` returns
    the loss. ``config`` (e.g. :func:`config_of` with some sizes changed) replaces
    ``config_of(arch, size)``; ``experts``: a tiny config's experts at :func:`with_experts`' sizes.
    A tiny model has one layer of each kind (:func:`tiny_config`), or where that one does not
    build or run, its first layers."""
    import transformers

    if config is None and size == "tiny":
        kw = dict(size=size, batch=batch, seq=seq, device=device, seed=seed)
        sized = with_experts if experts else (lambda c: c)
        try:  # some models refuse a layer of each kind (Zamba ties weights across two hybrids)
            return build(arch, config=sized(config_of(arch)), **kw)
        except BuildError:
            return build(arch, config=sized(config_of(arch, every_kind=False)), **kw)
    config = config if config is not None else config_of(arch, size)
    cls = getattr(transformers, arch.class_name, None)
    if cls is None:
        raise BuildError(f"{arch.name}: transformers has no class {arch.class_name}")
    own = getattr(cls, "config_class", None)
    if own is not None and not isinstance(config, own) and isinstance(config.get_text_config(), own):
        config = config.get_text_config()  # a text-only class of a multimodal model type (Qwen3.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            try:
                model = _instantiate(cls, config)
            except Exception as exc:
                raise BuildError(f"{arch.name}: building the model failed: {type(exc).__name__}: "
                                 f"{_first_line(exc)}") from exc
            if device is not None:  # a parameter made by torch.Tensor(n) ignores the device context (Wav2Vec2's)
                model = model.to(device)
            inputs = example_inputs(arch, model, batch=batch, seq=seq)
    return model.float().train(), inputs


def build_full(arch: Architecture, *, batch: int, seq: int, dtype=torch.bfloat16, device="meta",
               overrides: dict | None = None) -> tuple[nn.Module, dict]:
    """``(model, inputs)`` for ``arch`` at full size (its config class's defaults with
    ``overrides``; dropout-like probabilities at 0: :func:`without_randomness`) on ``device``, in
    ``dtype`` (its floating inputs too), on ``batch`` sequences of ``seq`` tokens or the model's
    longest, where that is shorter."""
    config = without_randomness(config_of(arch, "full"))  # dropout changes no cost; SpecAugment does not trace
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    text = config.get_text_config()
    longest = getattr(text, "max_position_embeddings", None) or getattr(text, "max_target_positions", None)
    model, inputs = build(arch, size="full", batch=batch, seq=min(seq, longest or seq), device=device, config=config)
    return model.to(dtype), cast_floating(inputs, dtype)  # images, audio: as the model's weights


@contextlib.contextmanager
def _as_if_compiling():
    """``torch.compiler.is_compiling()`` answers True inside, as under torch.export."""
    real = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = real


def fails_by_itself(model: nn.Module, inputs: dict, error: BaseException) -> str | None:
    """Why ``model`` fails in its own eager forward on ``inputs`` (as built: meta tensors are
    enough) with ``error``'s type and message, or None where it runs or fails otherwise: a
    config class whose defaults make a model that transformers itself cannot run (a top-k left
    unset, states kept in another dtype) is no failure of autopar's. The forward runs as under
    torch.export: told a compiler is tracing, transformers skips its checks of tensor values."""
    cause = error
    while cause.__cause__ is not None and isinstance(cause, AutoparError):
        cause = cause.__cause__
    try:
        with torch.no_grad(), _as_if_compiling():
            model(**inputs)
    except Exception as exc:  # noqa: BLE001  (any failure of the model's own code is the answer)
        if type(exc) is type(cause) and _first_line(exc) == _first_line(cause):
            return f"{type(exc).__name__}: {_first_line(exc)}"
    return None


def _instantiate(cls, config):
    for attn in ("sdpa", "eager"):
        try:
            return cls._from_config(config, attn_implementation=attn)
        except ValueError as exc:
            if attn == "eager" or "attn" not in str(exc).lower() and "attention" not in str(exc).lower():
                raise
    raise AssertionError("unreachable")


def _special_ids(config: dict) -> set[int]:
    """Every special token id in a config dict (nested ones included)."""
    out = set()
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _special_ids(value)
        elif str(key).endswith(("token_id", "token_index", "token_ids")):
            out.update(_ids(value))
    return out


def _int_of(config, *keys, default=None):
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)) and value and _is_int(value[0]):
            return value[0]
        if _is_int(value):
            return value
    return default


def _candidates(arch: Architecture, model: nn.Module, *, batch: int, seq: int):
    """Example inputs to try, in order: token ids avoid special ids; images, audio and
    spectrogram shapes come from the config (or usual defaults)."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    text = config.get_text_config()
    vocab = _int_of(text, "vocab_size", default=TINY_VOCAB)
    specials = _special_ids(config.to_dict())
    allowed = [i for i in range(3, min(vocab, TINY_VOCAB) - 1) if i not in specials]

    def ids(length):
        return torch.tensor(allowed)[torch.randint(0, len(allowed), (batch, length))]

    vision = getattr(config, "vision_config", None) or config
    size = _int_of(vision, "image_size", "input_size", default=224)
    channels = _int_of(vision, "num_channels", default=3)
    audio = getattr(config, "audio_config", None) or getattr(config, "encoder", None) or config
    mels = _int_of(audio, "num_mel_bins", "input_feat_per_channel", "feature_size", default=80)
    frames = 2 * _int_of(audio, "max_source_positions", default=8)
    label_kind = {"image-classification": "class", "audio-classification": "class", "ctc": "ctc",
                  "contrastive": None}.get(arch.task, "tokens")
    classes = getattr(config, "num_labels", 2)
    main_shapes = {
        "input_ids": [None],
        "pixel_values": [(batch, channels, size, size), (batch, channels, 64, 64)],
        "input_values": [(batch, 4000), (batch, _int_of(config, "max_length", default=64), mels),
                         (batch, mels, frames)],
        "input_features": [(batch, mels, frames), (batch, 64, mels), (batch, frames, mels)],
    }
    # a generic main input is its encoder's (SpeechEncoderDecoder's wav2vec2: audio), else
    # (Perceiver's ``inputs``) pixels for an image task, else token ids
    kind = main
    if main == "inputs":
        kind = getattr(getattr(model, "encoder", None), "main_input_name", None)
        if kind not in main_shapes:
            kind = "pixel_values" if arch.task == "image-classification" else "input_ids"
    if kind not in main_shapes:
        raise BuildError(f"{arch.name}: no example inputs for a model whose main input is {main!r}")
    for length in (seq, 64, 256):
        for shape in main_shapes[kind]:
            inputs = {}
            if "input_ids" in params and (main == "input_ids" or arch.task == "contrastive"):
                inputs["input_ids"] = ids(length)
            if main != "input_ids":
                inputs[main] = ids(length) if kind == "input_ids" else torch.randn(shape)
            if arch.task == "contrastive":
                inputs["pixel_values"] = torch.randn(batch, channels, size, size)
                inputs["return_loss"] = True
            elif label_kind == "class":
                inputs["labels"] = torch.randint(0, classes, (batch,))
            elif label_kind == "ctc":
                inputs["labels"] = ids(4)
            elif arch.task == "causal-lm" and "input_ids" in inputs:
                inputs["labels"] = inputs["input_ids"].clone()
            else:
                inputs["labels"] = ids(length)
            yield inputs


def example_inputs(arch: Architecture, model: nn.Module, *, batch: int = 4, seq: int = 16) -> dict:
    """The first candidate input (see :func:`_candidates`) whose forward returns a 0-dim loss;
    on the meta device (nothing runs) the first candidate."""
    errors = []
    for inputs in _candidates(arch, model, batch=batch, seq=seq):
        if next(model.parameters()).device.type == "meta":
            return inputs
        try:
            with torch.no_grad():
                loss = getattr(model(**inputs), "loss", None)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {_first_line(exc)}")
            continue
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return inputs
        errors.append("the output has no 0-dim .loss")
    raise BuildError(f"{arch.name}: no example input runs: {errors[0] if errors else 'none tried'}")
