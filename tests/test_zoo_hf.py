"""transformers architectures built from their config classes (autopar.zoo_hf), and a CI subset of
the zoo sweep (benchmarks/zoo_sweep.py): architectures of every kind, tiny, trained on two ranks
under autopar's plan like one process, with no pointwise op left without a rule."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings
from collections import Counter

import pytest
import torch

from autopar import Cluster, UnsupportedOpWarning, baselines
from autopar.compile import compile
from autopar.core.errors import CaptureError
from autopar.core.options import Options
from autopar.passes.rules.check import check_op
from autopar.runtime.graphio import pack
from autopar.runtime.verify.fake import VerifyError
from autopar.testing import run_programs
from one_process import one_process

pytest.importorskip("transformers")
import transformers
import transformers.integrations.moe  # noqa: E402,F401  (registers transformers::grouped_mm_fallback)

from autopar.zoo_hf import TASKS, TINY_LAYERS, architectures, build, config_of, fails_by_itself, is_moe  # noqa: E402

CI = [  # decoders, a state-space model, encoders, encoder-decoders, vision, audio
    "LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2ForCausalLM", "PhiForCausalLM",
    "FalconForCausalLM", "GPTNeoXForCausalLM", "MambaForCausalLM",
    "BertForMaskedLM", "RobertaForMaskedLM", "DistilBertForMaskedLM",
    "BartForConditionalGeneration",
    "ViTForImageClassification", "ConvNextForImageClassification",
    "ASTForAudioClassification", "WhisperForConditionalGeneration",
]


def _arch(name):
    return next(a for a in architectures() if a.class_name == name)


def test_architectures_cover_every_task_and_configs_shrink():
    archs = architectures()
    assert {a.task for a in archs} == set(TASKS)
    assert len({a.class_name for a in archs}) == len(archs)
    llama = config_of(_arch("LlamaForCausalLM"))
    assert llama.num_hidden_layers == TINY_LAYERS and llama.hidden_size <= 64 and llama.vocab_size <= 256
    assert config_of(_arch("LlamaForCausalLM"), "full").num_hidden_layers > TINY_LAYERS
    assert is_moe(config_of(_arch("MixtralForCausalLM"))) and not is_moe(llama)


def test_a_built_model_returns_its_loss_on_its_example_inputs():
    model, inputs = build(_arch("BertForMaskedLM"))
    out = model(**inputs)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)


@pytest.mark.slow
def test_a_zoo_subset_trains_on_two_ranks_like_one_process():
    cluster = Cluster.local(world_size=2)
    runs, refs, replicated = {}, {}, set()
    for name in CI:
        model, inputs = build(_arch(name))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnsupportedOpWarning)
            runs[name] = (compile(model, cluster, example_inputs=inputs), inputs, None)
        replicated |= {str(w.message).split()[4].rstrip(";") for w in caught
                       if issubclass(w.category, UnsupportedOpWarning)}
        refs[name] = one_process(model, inputs=inputs, steps=2, optimizer="sgd", lr=0.01)
    pointwise = [op for op in replicated
                 if torch.Tag.pointwise in getattr(getattr(torch.ops.aten, op.split(".")[1]), op.split(".")[2]).tags]
    assert pointwise == []
    results = run_programs(runs, steps=2, lr=0.01, return_parameters=True, timeout=1200)
    wrong = {name: ref.mismatches(*results[name]) for name, ref in refs.items()}
    assert {name: why for name, why in wrong.items() if why} == {}


def test_an_encoder_decoder_config_without_a_decoder_start_token_starts_at_its_pad_token():
    config = config_of(_arch("T5ForConditionalGeneration"))
    assert config.decoder_start_token_id == config.pad_token_id is not None
    model, inputs = build(_arch("T5ForConditionalGeneration"))
    assert model(**inputs).loss.dim() == 0


def test_an_encoder_decoder_pair_takes_its_pad_and_start_tokens_from_its_decoder():
    config = config_of(_arch("EncoderDecoderModel"), "full")
    assert config.pad_token_id == config.decoder_start_token_id == config.decoder.pad_token_id is not None


def test_a_generic_main_input_is_its_encoders_and_a_failure_the_model_repeats_is_named():
    model, inputs = build(_arch("SpeechEncoderDecoderModel"))  # forward(inputs=...), a wav2vec2 encoder
    assert inputs["inputs"].dim() == 2 and inputs["inputs"].is_floating_point()
    assert model(**inputs).loss.dim() == 0
    assert fails_by_itself(model, inputs, CaptureError("could not trace")) is None  # it runs
    unset = transformers.DeepseekV2ForCausalLM(config_of(_arch("DeepseekV2ForCausalLM")))  # top-k left unset
    ids = torch.randint(3, 100, (2, 8))
    error = CaptureError("torch.export could not trace the model")
    error.__cause__ = TypeError("topk(): argument 'k' must be int, not NoneType")
    assert fails_by_itself(unset, {"input_ids": ids, "labels": ids}, error).startswith("TypeError: topk()")
    error.__cause__ = TypeError("another message")
    assert fails_by_itself(unset, {"input_ids": ids, "labels": ids}, error) is None


def test_a_learned_attention_bias_keeps_the_predicted_activations():
    """T5 adds a learned position bias to attention's mask: with the mask needing a gradient the
    CPU attention kernel hands another layout than at capture, which the captured ``view`` of its
    output did not take, so capture saw no saved tensors and the plan predicted no activations
    (0.27 of the measured peak). Capture now runs views as reshapes, as programs do."""
    model, inputs = build(_arch("T5ForConditionalGeneration"))
    local = Cluster.local(world_size=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="capture could not run the graph again")
        plan = baselines.data_parallel(model, local, example_inputs=inputs)
    (rank,) = compile(model, local, example_inputs=inputs, plan=plan).verify().ranks
    assert rank.predicted.memory["activations"] == pytest.approx(rank.measured.memory["activations"], rel=0.10)
    assert rank.predicted.peak == pytest.approx(rank.measured.peak, rel=0.10)


def test_batch_norm_statistics_split_over_channels_are_gathered_as_the_plan_records():
    """A batch norm split over channels updates its running statistics in pieces; the program
    gathers them into the replicated buffers, which the plan's records left out (ResNet on 4
    ranks: 26 all-gathers issued that no record predicted)."""
    model, inputs = build(_arch("ResNetForImageClassification"))
    compiled = compile(model, Cluster.local(world_size=4), example_inputs=inputs, options=Options(pipeline=False))
    norms = [n for n in compiled.plan.nodes if "batch_norm" in n.op]
    assert any("S" in "".join(n.outputs) for n in norms)  # some statistics are split
    (rank,) = compiled.verify().ranks
    assert rank.collective_diff() == (Counter(), Counter())


def test_verify_says_so_when_a_program_reads_tensor_values_fake_tensors_cannot_give():
    """XLM's forward reads a tensor's value (``_local_scalar_dense``); verify let torch's
    DataDependentOutputException through."""
    model, inputs = build(_arch("XLMWithLMHeadModel"))
    compiled = compile(model, Cluster.local(world_size=2), example_inputs=inputs, options=Options(pipeline=False))
    with pytest.raises(VerifyError, match="reads a tensor's value"):
        compiled.verify()


def test_a_config_that_leaves_its_vocabulary_to_checkpoints_gets_a_tiny_one_and_its_special_ids():
    config = config_of(_arch("EsmForMaskedLM"))  # EsmConfig(): vocab_size, pad and mask ids None
    assert config.vocab_size == 256
    special = {config.pad_token_id, config.mask_token_id}
    assert len(special) == 2 and max(special) < 256
    model, inputs = build(_arch("EsmForMaskedLM"))
    assert model(**inputs).loss.dim() == 0


def test_a_partial_rotary_width_shrinks_below_the_tiny_head_width():
    config = config_of(_arch("CodeGenForCausalLM"))  # rotary_dim 64 of head width 256 by default
    assert config.rotary_dim <= config.n_embd // config.n_head
    model, inputs = build(_arch("CodeGenForCausalLM"))
    assert model(**inputs).loss.dim() == 0


def test_a_nested_config_keeps_its_model_type_when_shrunk():
    """MusicFlamingoConfig reads ``audio_config["model_type"]`` from the dict it is given."""
    config = config_of(_arch("MusicFlamingoForConditionalGeneration"))
    full = config_of(_arch("MusicFlamingoForConditionalGeneration"), "full")
    assert config.audio_config.model_type == full.audio_config.model_type
    assert config.audio_config.num_hidden_layers == TINY_LAYERS


def test_per_stage_lists_keep_one_entry_per_stage_and_head_counts_divide_the_stage_widths():
    """Swin V2: num_layers counts the stages of ``depths`` (per-stage lists stay whole) and heads
    [3, 6, 12, 24] did not divide the tiny stage widths 64 * 2**i."""
    config = config_of(_arch("Swinv2ForImageClassification"))
    assert len(config.pretrained_window_sizes) == len(config.depths) == len(config.num_heads)
    assert all(config.embed_dim * 2**i % h == 0 for i, h in enumerate(config.num_heads))
    model, inputs = build(_arch("Swinv2ForImageClassification"))
    assert model(**inputs).loss.dim() == 0


def test_a_nested_config_gets_every_dropout_like_field_at_zero():
    """CanaryConfig() holds its encoder at layerdrop 0; a dict without the field took Parakeet's 0.1
    (layers dropped at random in training: no trace)."""
    assert config_of(_arch("CanaryForConditionalGeneration")).encoder_config.layerdrop == 0.0


def test_unset_key_value_heads_become_the_tiny_head_count():
    config = config_of(_arch("NemotronForCausalLM"))  # NemotronConfig(): num_key_value_heads None
    assert config.num_key_value_heads == config.num_attention_heads == 4


def test_tiny_configs_do_not_depend_on_the_string_hash_seed():
    """Qwen3-Next has two head counts; which one sized its key heads followed a set's order."""
    code = ("from autopar.zoo_hf import architectures, config_of; "
            "print(config_of(next(a for a in architectures() if a.model_type == 'qwen3_next')).to_dict())")
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in range(4)}
    assert len(seen) == 1


def test_a_generic_main_input_of_an_image_classifier_is_pixels():
    model, inputs = build(_arch("PerceiverForImageClassificationLearned"))  # forward(inputs=...)
    assert inputs["inputs"].dim() == 4 and inputs["inputs"].is_floating_point()
    assert model(**inputs).loss.dim() == 0


@pytest.mark.slow
def test_a_weight_used_in_and_out_of_a_tensor_parallel_region_gets_its_gradient_once():
    """ALBERT under tp=2: the tied word embedding (and each layer norm of the layer shared by
    every layer) is used where gradients are pending sums (summed by Megatron's f) and where they
    are whole; a bucketed sum of the parameter's whole gradient counted the whole ones twice."""
    model, inputs = build(_arch("AlbertForMaskedLM"))
    local = Cluster.local(world_size=2)
    free = baselines.megatron(model, local, tp=2, example_inputs=inputs)
    # memory pressure that shards some of the word embedding's uses: at which fraction depends on
    # the solver's pick among equally fast plans (at 0.7 HiGHS with its presolve shards them, without
    # it an as fast plan does not), so a fine walk
    for fraction in (0.9 - 0.025 * k for k in range(13)):
        tight = dataclasses.replace(local, device_memory=free.predicted_peak_memory * fraction)
        tp = baselines.megatron(model, tight, tp=2, example_inputs=inputs, options=Options(memory_fraction=1.0))
        compiled = compile(model, local.with_mesh(tp.mesh_shape), example_inputs=inputs, plan=tp)
        if "bucket = False" in compiled.code(rank=0):
            break
    else:
        raise AssertionError("no tp=2 plan of ALBERT mixes whole and pending gradients of one parameter")
    ref = one_process(model, inputs=inputs, steps=2, optimizer="sgd", lr=0.01)
    results = run_programs({"albert": (compiled, inputs, None)}, steps=2, lr=0.01, return_parameters=True)
    assert ref.mismatches(*results["albert"]) == []


def test_a_packed_program_names_the_module_that_registers_its_custom_op():
    """Spawned ranks import it before rebuilding the program (Mixtral's grouped matmul)."""
    graph = torch.fx.Graph()
    x, w, offs = (graph.placeholder(n) for n in ("x", "w", "offs"))
    mm = graph.call_function(torch.ops.transformers.grouped_mm_fallback.default, (x, w, offs))
    graph.output(graph.call_function(torch.ops.aten.relu.default, (mm,)))
    assert pack(torch.fx.GraphModule(torch.nn.Module(), graph))["modules"] == ["transformers.integrations.moe"]


@pytest.mark.slow
def test_a_routed_moe_trains_like_one_process_under_autopar_fsdp_and_tensor_parallel_plans():
    """Its experts traced as the model's sorted grouped matmul (autopar's "auto" pick at these
    sizes) and as a dense dispatch (the baselines', and asked for)."""
    model, inputs = build(_arch("MixtralForCausalLM"))
    local = Cluster.local(world_size=2)
    plans = {"auto": None, "fsdp": baselines.fsdp(model, local, example_inputs=inputs),
             "tp": baselines.megatron(model, local, tp=2, example_inputs=inputs)}
    runs = {name: (compile(model, local.with_mesh(plan.mesh_shape) if plan else local, example_inputs=inputs,
                           plan=plan), inputs, None) for name, plan in plans.items()}
    runs["auto dense"] = (compile(model, local, example_inputs=inputs, options=Options(moe_dispatch="dense")),
                          inputs, None)
    assert "grouped_mm_fallback" in runs["auto"][0].code(rank=0)
    assert all("grouped_mm_fallback" not in runs[name][0].code(rank=0) for name in ("auto dense", "fsdp", "tp"))
    ref = one_process(model, inputs=inputs, steps=2, optimizer="sgd", lr=0.01)
    results = run_programs(runs, steps=2, lr=0.01, return_parameters=True, timeout=1200)
    assert {name: ref.mismatches(*results[name]) for name in runs} == {name: [] for name in runs}


def test_transformers_grouped_matmul_has_tensor_parallel_strategies_that_match_the_op():
    report = check_op(torch.ops.transformers.grouped_mm_fallback.default)
    assert report.failures == [] and report.sharded_strategies > 0


def test_a_full_size_model_on_meta_has_every_parameter_there_and_loses_its_randomness():
    """Wav2Vec2 makes its masked-spec embedding with torch.Tensor(n), which ignores the device
    context; SpecAugment and dropout probabilities go to 0, nested configs' too."""
    from autopar.zoo_hf import without_randomness

    arch = next(a for a in architectures() if a.class_name == "Wav2Vec2ForSequenceClassification")
    config = config_of(arch, "full")
    assert config.mask_time_prob > 0 and config.hidden_dropout > 0
    model, _ = build(arch, size="full", batch=2, seq=16, device="meta", config=without_randomness(config))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert config.mask_time_prob == 0 and config.hidden_dropout == 0 and config.feat_proj_dropout == 0
    clip = config_of(next(a for a in architectures() if a.class_name == "ChineseCLIPModel"), "full")
    assert clip.text_config.hidden_dropout_prob > 0
    assert without_randomness(clip).text_config.hidden_dropout_prob == 0


def test_a_pipeline_search_prices_a_0_dim_value_crossing_its_stages():
    """Full-size SEW-D has a 0-dim value read across its pipeline stages: the stage costs asked
    whether it is as long as the batch from its empty shape and failed (int(()))."""
    from autopar.zoo_hf import without_randomness

    arch = next(a for a in architectures() if a.class_name == "SEWDForSequenceClassification")
    model, inputs = build(arch, size="full", batch=32, seq=64, device="meta",
                          config=without_randomness(config_of(arch, "full")))
    plan = compile(model, Cluster.preset("dgx-a100", nodes=1), example_inputs=inputs,
                   options=Options(pipeline=True)).plan
    assert plan.stages and plan.predicted_step_time > 0


@pytest.mark.slow
def test_a_pipeline_search_does_not_send_a_parameter_tied_across_layers():
    """Zamba2's hybrid layers share one block, whose parameters the first part of a pipeline
    window holds and the layers read: not an activation the stage sends (it raised KeyError)."""
    from autopar.zoo_hf import without_randomness

    arch = next(a for a in architectures() if a.class_name == "Zamba2ForCausalLM")
    config = without_randomness(config_of(arch, "full"))
    config.num_hidden_layers, config.layers_block_type = 26, config.layers_block_type[:26]
    config.hybrid_layer_ids = [i for i in config.hybrid_layer_ids if i < 26]
    model, inputs = build(arch, size="full", batch=8, seq=128, device="meta", config=config)
    plan = compile(model, Cluster.preset("dgx-a100", nodes=1), example_inputs=inputs,
                   options=Options(pipeline=True)).plan
    assert plan.predicted_step_time > 0
