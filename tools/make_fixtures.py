#!/usr/bin/env python3
"""Build the tiny Z-Image-Turbo checkpoint and golden tensors that `pipeline-zimage`'s tests read.

Usage (from the repository root, inside the gitignored venv):

    python3 -m venv .venv && .venv/bin/pip install -r tools/requirements-fixtures.txt
    .venv/bin/python tools/make_fixtures.py --out crates/pipeline-zimage/tests/fixtures

What it writes under --out:

* `tiny-z-image-turbo/`: a complete diffusers checkpoint directory in the real Z-Image-Turbo layout, made with the
  real classes (`ZImagePipeline`, `ZImageTransformer2DModel`, transformers `Qwen3Model`, `AutoencoderKL`,
  `FlowMatchEulerDiscreteScheduler`, `Qwen2Tokenizer`) and saved with `save_pretrained` as float32 safetensors.
  Only the sizes are tiny. The transformer and the text encoder are saved SHARDED (an index json plus >= 2 shards),
  the VAE as one file, like the real repository.
* `golden/`: inputs and expected outputs per component and for the whole pipeline; `golden/README.md` is the contract
  (every file, tensor name, shape and meaning) and is written by this script.

Determinism: every random number comes from one explicitly seeded `torch.Generator` (CPU), drawn in a fixed order, and
torch runs single-threaded with deterministic algorithms, so rerunning the script with the same package versions
reproduces the files bit for bit (modulo float summation order of the installed torch build).

Randomness inside diffusers is removed, not seeded (see `golden/README.md`, "Patches"):

* `DiagonalGaussianDistribution.sample` (used by the img2img pipeline through `retrieve_latents`) is patched to return
  the distribution's mean (= `mode()`), so the image latents are the VAE encoder's mean.
* `randn_tensor` in the img2img pipeline module (the noise of `scale_noise`) is patched to return the tensor stored as
  `noise` in `golden/pipeline_img2img.safetensors`.
* The text-to-image pipelines get their initial noise through the public `latents=` argument.
"""

from __future__ import annotations

import argparse
import sys
import json
import os
import shutil
from pathlib import Path

import torch

SEED = 20240601

# Tiny sizes. `cap_feat_dim` of the transformer must equal the text encoder's hidden size.
TE_HIDDEN = 32
TRANSFORMER_KW = dict(
    all_patch_size=[2],
    all_f_patch_size=[1],
    in_channels=16,
    dim=64,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=TE_HIDDEN,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[8, 12, 12],
    axes_lens=[128, 32, 32],
)
VAE_KW = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    # Four blocks keep vae_scale_factor = 2 ** (4 - 1) = 8, like the real FLUX VAE.
    block_out_channels=[16, 16, 32, 32],
    layers_per_block=1,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=8,
    sample_size=64,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
    force_upcast=True,
)
SCHEDULER_KW = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
MAX_SEQ = 32
HEIGHT = WIDTH = 64

# The standard Qwen3 chat template (as shipped in Qwen3 tokenizer_config.json files).
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS = [
    "user", "assistant", "system", "user\n", "assistant\n",
    "a photo of a red fox sitting in the snow at sunrise",
    "a cat wearing a tiny hat, studio lighting, highly detailed",
    "an astronaut riding a horse on the moon, digital art",
    "a bowl of ramen with chopsticks, steam rising, close-up photo",
    "the quick brown fox jumps over the lazy dog",
    "portrait of an old fisherman, dramatic light, 35mm film",
    "mountains and a lake at dusk, oil painting, warm colours",
    "blurry, low quality, watermark, text, deformed hands",
    "Hello, world! 12345 67890",
    "ÄÖÜ ß é ñ 中文 日本語 emoji 🙂",
]

TOKENIZER_PROMPTS = [
    "a photo of a red fox sitting in the snow at sunrise",
    "",
    "blurry, low quality",
    "Hello, world! 中文 🙂 with unseen wordz",
    # Long enough that the chat-templated text is truncated to MAX_SEQ tokens.
    "an astronaut riding a horse on the moon, digital art, portrait of an old fisherman, dramatic light, 35mm film, "
    "mountains and a lake at dusk, oil painting, warm colours",
]
PIPELINE_PROMPT = "a red fox in the snow"
NEGATIVE_PROMPT = "blurry, low quality"


def randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter with O(1)-scaled random values so that every tensor matters numerically.

    Default inits leave norm weights at one, biases and pad tokens at zero or uninitialised, which would let a wrong
    key mapping pass a parity test. Order: `named_parameters()` order, one draw per tensor.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim == 1 and leaf == "weight":  # norm weights (RMSNorm, GroupNorm)
                p.copy_(1.0 + 0.1 * r)
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * r)
            elif "embed_tokens" in name or "pad_token" in name:
                p.copy_(r)
            else:  # Linear / Conv weights: unit-variance outputs for unit-variance inputs
                fan_in = 1
                for s in p.shape[1:]:
                    fan_in *= s
                p.copy_(r / fan_in**0.5)


def build_tokenizer(dir_: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    dir_.mkdir(parents=True, exist_ok=True)
    tok.save(str(dir_ / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 131072,
        "padding_side": "right",
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": QWEN3_CHAT_TEMPLATE,
    }
    (dir_ / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(dir_))


def shard_save(model, dir_: Path, n_target: int = 2) -> None:
    """save_pretrained with a max_shard_size small enough for at least `n_target` shards."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # The directory's earlier files were this tool's and are gone (OwnedOutput.prepare); nothing else is removed.
    model.save_pretrained(str(dir_), safe_serialization=True, max_shard_size=max(total // (n_target + 1), 1))
    idx = [f for f in os.listdir(dir_) if f.endswith(".safetensors.index.json")]
    shards = [f for f in os.listdir(dir_) if f.endswith(".safetensors")]
    assert len(idx) == 1 and len(shards) >= 2, (dir_, idx, shards)


# Per-file metadata, written to golden/meta.json. (safetensors headers would serialise it in hash order, which
# makes the files differ byte-wise between runs; a sorted JSON file keeps the fixtures byte-reproducible.)
META: dict[str, dict] = {}


def save_st(path: Path, tensors: dict, meta: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.float32).contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in tensors.items()}, str(path))
    if meta:
        META[path.name] = meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--force", action="store_true",
                    help="write into non-empty directories this tool did not make (their files are kept)")
    args = ap.parse_args()
    out: Path = args.out
    ckpt = out / "tiny-z-image-turbo"
    golden = out / "golden"
    # Never removes what it did not write: each directory is refused when it holds files no generator listed
    # (unless --force), and only the files this tool's manifest lists are removed (tools/owned_output.py).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from owned_output import OwnedOutput

    owned = [OwnedOutput(d, "tools/make_fixtures.py", args.force, tag="fixtures") for d in (ckpt, golden)]
    for directory in owned:
        directory.prepare()

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(SEED)

    import diffusers
    import tokenizers
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageImg2ImgPipeline, ZImagePipeline
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    # ---- components -------------------------------------------------------------------------------------------
    tokenizer = build_tokenizer(ckpt / "tokenizer")
    vocab = len(tokenizer)

    te_config = Qwen3Config(
        vocab_size=vocab, hidden_size=TE_HIDDEN, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, hidden_act="silu", max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
        attention_bias=False, pad_token_id=tokenizer.pad_token_id,
    )
    text_encoder = Qwen3Model(te_config).eval()
    randomize(text_encoder, gen)

    transformer = ZImageTransformer2DModel(**TRANSFORMER_KW).eval()
    randomize(transformer, gen)

    vae = AutoencoderKL(**VAE_KW).eval()
    randomize(vae, gen)

    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_KW)

    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(str(ckpt), safe_serialization=True)
    # The real repository ships the two big models sharded; re-save those two with a small shard size.
    shard_save(transformer, ckpt / "transformer")
    shard_save(text_encoder, ckpt / "text_encoder")
    # The tokenizer dir written by save_pretrained replaces ours; put the hand-built files back verbatim so the
    # Rust side reads exactly what Python was checked against.
    shutil.rmtree(ckpt / "tokenizer")
    tokenizer = build_tokenizer(ckpt / "tokenizer")

    # Reload the whole pipeline from disk so the goldens come from the files the Rust side reads.
    pipe = ZImagePipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    tokenizer, text_encoder, transformer, vae = pipe.tokenizer, pipe.text_encoder, pipe.transformer, pipe.vae
    assert pipe.vae_scale_factor == 8, pipe.vae_scale_factor

    versions = {
        "torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__, "seed": SEED,
    }
    (golden / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")

    # ---- tokenizer -------------------------------------------------------------------------------------------
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(ckpt / "tokenizer" / "tokenizer.json"))
    templated = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=True)
                 for p in TOKENIZER_PROMPTS]
    for p, t in zip(TOKENIZER_PROMPTS, templated):
        assert t == f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n", repr(t)
    enc = tokenizer(templated, padding="max_length", max_length=MAX_SEQ, truncation=True, return_tensors="pt")
    for i, t in enumerate(templated):
        raw_ids = raw.encode(t).ids[:MAX_SEQ]
        assert raw_ids == enc.input_ids[i][: len(raw_ids)].tolist(), (t, raw_ids, enc.input_ids[i])
    tok_golden = {
        "max_sequence_length": MAX_SEQ,
        "pad_token": "<|endoftext|>",
        "pad_token_id": tokenizer.pad_token_id,
        "vocab_size": vocab,
        "cases": [
            {"prompt": p, "templated": t, "input_ids": enc.input_ids[i].tolist(),
             "attention_mask": enc.attention_mask[i].tolist()}
            for i, (p, t) in enumerate(zip(TOKENIZER_PROMPTS, templated))
        ],
    }
    (golden / "tokenizer.json").write_text(json.dumps(tok_golden, indent=2, ensure_ascii=False) + "\n")

    # ---- text encoder ---------------------------------------------------------------------------------------
    with torch.no_grad():
        te_prompts = [TOKENIZER_PROMPTS[0], TOKENIZER_PROMPTS[1], TOKENIZER_PROMPTS[4]]
        embeds = pipe._encode_prompt(list(te_prompts), device=torch.device("cpu"), max_sequence_length=MAX_SEQ)
        te_enc = tokenizer([templated[0], templated[1], templated[4]], padding="max_length", max_length=MAX_SEQ,
                           truncation=True, return_tensors="pt")
        hs = text_encoder(input_ids=te_enc.input_ids, attention_mask=te_enc.attention_mask.bool(),
                          output_hidden_states=True).hidden_states
    te_tensors = {"input_ids": te_enc.input_ids.to(torch.int64), "attention_mask": te_enc.attention_mask.to(torch.int64),
                  "hidden_states_m2": hs[-2]}
    for i, e in enumerate(embeds):
        te_tensors[f"prompt_embeds_{i}"] = e
    save_st(golden / "text_encoder.safetensors", te_tensors,
            {"prompts": te_prompts, "max_sequence_length": MAX_SEQ})

    # ---- transformer ----------------------------------------------------------------------------------------
    # Latent 8x12 -> 4*6 = 24 image tokens (padded to 32); caption 13 tokens (padded to 32).
    with torch.no_grad():
        x = torch.randn(16, 1, 8, 12, generator=gen)
        t = torch.tensor([0.3])
        cap = torch.randn(13, TE_HIDDEN, generator=gen)
        out_tr = transformer([x], t, [cap], return_dict=False)[0][0]
        save_st(golden / "transformer.safetensors", {"x": x, "t": t, "cap_feats": cap, "out": out_tr})
        # Batch of two with unequal caption AND image lengths: exercises the batch attention mask.
        x0 = torch.randn(16, 1, 8, 8, generator=gen)
        x1 = torch.randn(16, 1, 8, 12, generator=gen)
        tb = torch.tensor([0.25, 0.75])
        c0 = torch.randn(7, TE_HIDDEN, generator=gen)
        c1 = torch.randn(40, TE_HIDDEN, generator=gen)
        ob = transformer([x0, x1], tb, [c0, c1], return_dict=False)[0]
        save_st(golden / "transformer_batch2.safetensors",
                {"x_0": x0, "x_1": x1, "t": tb, "cap_feats_0": c0, "cap_feats_1": c1, "out_0": ob[0], "out_1": ob[1]})

    # ---- VAE ------------------------------------------------------------------------------------------------
    with torch.no_grad():
        lat = torch.randn(1, 16, 8, 8, generator=gen)
        dec = vae.decode(lat, return_dict=False)[0]
        img = torch.rand(1, 3, HEIGHT, WIDTH, generator=gen) * 2 - 1
        mean = vae.encode(img).latent_dist.mean
        save_st(golden / "vae.safetensors", {"latents": lat, "decoded": dec, "image": img, "latent_mean": mean})

    # ---- scheduler ------------------------------------------------------------------------------------------
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

    sched_cases, i2i_cases = [], []
    for n in (2, 4, 8):
        s = FlowMatchEulerDiscreteScheduler.from_pretrained(str(ckpt / "scheduler"))
        s.set_timesteps(sigmas=get_default_z_image_sigmas(n), mu=calculate_shift(16))
        sched_cases.append({"num_inference_steps": n, "sigmas": s.sigmas.tolist(), "timesteps": s.timesteps.tolist()})
        init_timestep = min(n * 0.6, n)
        t_start = int(max(n - init_timestep, 0))
        i2i_cases.append({"num_inference_steps": n, "strength": 0.6, "t_start": t_start,
                          "timesteps": s.timesteps[t_start:].tolist(), "sigmas": s.sigmas[t_start:].tolist()})
    # One Euler step and one scale_noise on small vectors.
    s = FlowMatchEulerDiscreteScheduler.from_pretrained(str(ckpt / "scheduler"))
    s.set_timesteps(sigmas=get_default_z_image_sigmas(4))
    sample = torch.randn(6, generator=gen)
    model_out = torch.randn(6, generator=gen)
    s.set_begin_index(1)
    stepped = s.step(model_out, s.timesteps[1], sample, return_dict=False)[0]
    s2 = FlowMatchEulerDiscreteScheduler.from_pretrained(str(ckpt / "scheduler"))
    s2.set_timesteps(sigmas=get_default_z_image_sigmas(4))
    s2.set_begin_index(1)
    noise = torch.randn(6, generator=gen)
    noised = s2.scale_noise(sample[None], s2.timesteps[1:2], noise[None])[0]
    sched_golden = {
        "config": SCHEDULER_KW,
        "set_timesteps": sched_cases,
        "img2img": i2i_cases,
        "step": {"num_inference_steps": 4, "step_index": 1, "sample": sample.tolist(), "model_output": model_out.tolist(),
                 "prev_sample": stepped.tolist()},
        "scale_noise": {"num_inference_steps": 4, "step_index": 1, "sample": sample.tolist(), "noise": noise.tolist(),
                        "noised": noised.tolist()},
    }
    (golden / "scheduler.json").write_text(json.dumps(sched_golden, indent=2) + "\n")

    # ---- whole pipeline -------------------------------------------------------------------------------------
    def run_t2i(name, steps, guidance, negative):
        latents = torch.randn(1, 16, HEIGHT // 8, WIDTH // 8, generator=gen)
        trace = []

        def cb(_pipe, _i, _t, kw):
            trace.append(kw["latents"].clone())
            return {}

        with torch.no_grad():
            pos, neg = pipe.encode_prompt(PIPELINE_PROMPT, device=torch.device("cpu"),
                                          do_classifier_free_guidance=guidance > 0, negative_prompt=negative,
                                          max_sequence_length=MAX_SEQ)
            image = pipe(prompt=PIPELINE_PROMPT, negative_prompt=negative, height=HEIGHT, width=WIDTH,
                         num_inference_steps=steps, guidance_scale=guidance, latents=latents.clone(),
                         output_type="pt", max_sequence_length=MAX_SEQ, callback_on_step_end=cb).images
        tensors = {"latents": latents, "step_latents": torch.cat(trace, 0), "image": image, "prompt_embeds": pos[0]}
        if neg:
            tensors["negative_prompt_embeds"] = neg[0]
        meta = {"prompt": PIPELINE_PROMPT, "negative_prompt": negative, "height": HEIGHT, "width": WIDTH,
                "num_inference_steps": steps, "guidance_scale": guidance, "max_sequence_length": MAX_SEQ,
                "output_type": "pt"}
        save_st(golden / f"{name}.safetensors", tensors, meta)

    run_t2i("pipeline_t2i_turbo", 4, 0.0, None)
    run_t2i("pipeline_t2i_cfg", 3, 4.0, NEGATIVE_PROMPT)

    # img2img: patch away the two random draws (see module docstring).
    import diffusers.models.autoencoders.vae as vae_mod
    import diffusers.pipelines.z_image.pipeline_z_image_img2img as i2i_mod

    i2i = ZImageImg2ImgPipeline(**pipe.components)
    i2i.set_progress_bar_config(disable=True)
    init_image = torch.rand(1, 3, HEIGHT, WIDTH, generator=gen)  # in [0, 1]; the pipeline maps it to [-1, 1]
    noise = torch.randn(1, 16, HEIGHT // 8, WIDTH // 8, generator=gen)
    orig_sample, orig_randn = vae_mod.DiagonalGaussianDistribution.sample, i2i_mod.randn_tensor
    vae_mod.DiagonalGaussianDistribution.sample = lambda self, generator=None: self.mean
    i2i_mod.randn_tensor = lambda shape, **kw: noise.clone().reshape(shape)
    trace = []

    def cb2(_pipe, _i, _t, kw):
        trace.append(kw["latents"].clone())
        return {}

    try:
        with torch.no_grad():
            image = i2i(prompt=PIPELINE_PROMPT, image=init_image, strength=0.6, height=HEIGHT, width=WIDTH,
                        num_inference_steps=4, guidance_scale=0.0, output_type="pt", max_sequence_length=MAX_SEQ,
                        callback_on_step_end=cb2).images
            image_latents = (vae.encode(init_image * 2 - 1).latent_dist.mean - vae.config.shift_factor) \
                * vae.config.scaling_factor
    finally:
        vae_mod.DiagonalGaussianDistribution.sample, i2i_mod.randn_tensor = orig_sample, orig_randn
    save_st(golden / "pipeline_img2img.safetensors",
            {"init_image": init_image, "noise": noise, "image_latents": image_latents,
             "step_latents": torch.cat(trace, 0), "image": image},
            {"prompt": PIPELINE_PROMPT, "height": HEIGHT, "width": WIDTH, "num_inference_steps": 4, "strength": 0.6,
             "guidance_scale": 0.0, "max_sequence_length": MAX_SEQ, "output_type": "pt"})

    (golden / "meta.json").write_text(json.dumps(META, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    (golden / "README.md").write_text(README.format(**versions))
    for directory in owned:
        directory.finish()
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote fixtures to {out} ({total / 1e6:.2f} MB)")


README = """# Golden values for pipeline-zimage

Made by `tools/make_fixtures.py` (seed {seed}) with torch {torch}, diffusers {diffusers}, transformers {transformers},
tokenizers {tokenizers} (also in `versions.json`). All float tensors are float32 safetensors, integer tensors int64.
The call arguments of each golden (prompts, sizes, steps, guidance, ...) are in `meta.json`, keyed by file name.
Rerunning the script with the same package versions reproduces every file byte for byte.
Everything was computed on the CPU in float32 from the checkpoint in `../tiny-z-image-turbo/`, reloaded from disk
with `ZImagePipeline.from_pretrained` (so the goldens match the files, not in-memory modules).
Shapes are written in PyTorch order.

## The tiny checkpoint (`../tiny-z-image-turbo/`)

Real diffusers layout and classes, tiny sizes, random O(1) weights (norm weights 1+0.1*N, biases 0.1*N, pad tokens and
embeddings N(0,1), matrices N(0,1/fan_in)):

* `model_index.json`: written by `ZImagePipeline.save_pretrained`.
* `transformer/`: `ZImageTransformer2DModel` dim 64, 2 heads (head_dim 32), 2 kv heads, 2 layers, 2 refiner layers,
  axes_dims [8,12,12], axes_lens [128,32,32], cap_feat_dim 32, in_channels 16, patch 2, f_patch 1, qk_norm, rope_theta
  256, t_scale 1000. Sharded: `diffusion_pytorch_model.safetensors.index.json` + >= 2 shards.
* `text_encoder/`: transformers `Qwen3Model` hidden 32, 3 layers, 4 heads, 2 kv heads, head_dim 8, intermediate 64,
  vocab = tokenizer size, rms eps 1e-6, `rope_parameters.rope_theta` 10000 (transformers 5 writes the RoPE theta under
  `rope_parameters`; older configs such as the real one write a top-level `rope_theta`). Saved by
  `Qwen3Model.save_pretrained`, so the keys have NO `model.` prefix (`embed_tokens.weight`, `layers.0...`, `norm.weight`).
  Sharded: `model.safetensors.index.json` + >= 2 shards.
* `vae/`: `AutoencoderKL` with the FLUX structure: 4 down/up blocks, block_out_channels [16,16,32,32], layers_per_block
  1, norm_num_groups 8, latent_channels 16, no quant convs, mid-block attention, scaling 0.3611, shift 0.1159.
  vae_scale_factor = 2**(4-1) = 8 like the real one. One file `diffusion_pytorch_model.safetensors`.
* `scheduler/scheduler_config.json`: `FlowMatchEulerDiscreteScheduler` shift 3.0, use_dynamic_shifting false.
* `tokenizer/`: `tokenizer.json` (byte-level BPE trained on a tiny corpus with the Qwen2 normalizer NFC, Qwen2 split
  regex + ByteLevel pre-tokenizer, ByteLevel decoder; added special tokens `<|endoftext|>` (pad), `<|im_start|>`,
  `<|im_end|>`, `<think>`, `</think>`), `tokenizer_config.json` (Qwen2Tokenizer, pad `<|endoftext|>`, padding right,
  the standard Qwen3 chat template).

## Files

`versions.json` (package versions and seed), `meta.json` (call arguments per golden file), and:

### `tokenizer.json` (JSON)
`max_sequence_length` (32), `pad_token`, `pad_token_id`, `vocab_size`, `cases`: list of
`{{prompt, templated, input_ids[32], attention_mask[32]}}`. `templated` is
`tokenizer.apply_chat_template([{{"role":"user","content":prompt}}], tokenize=False, add_generation_prompt=True,
enable_thinking=True)` = `<|im_start|>user\\n{{prompt}}<|im_end|>\\n<|im_start|>assistant\\n`; ids/mask come from
`tokenizer(templated, padding="max_length", max_length=32, truncation=True)` (pad right with the pad id, mask 0 there).
Case 1 is the empty prompt (the default negative prompt); the last case is long enough to be truncated.

### `text_encoder.safetensors`
`meta.json`: `prompts` (the 3 prompts = tokenizer cases 0, 1 and 4), `max_sequence_length` (32).
* `input_ids` int64 [3,32], `attention_mask` int64 [3,32]: as in `tokenizer.json`.
* `hidden_states_m2` [3,32,32]: `text_encoder(input_ids, attention_mask.bool(), output_hidden_states=True)
  .hidden_states[-2]` for the padded batch (embeddings + all layers but the last, no final norm). Rows at padded
  positions are whatever HF computes there; compare only valid rows.
* `prompt_embeds_{{i}}` [L_i,32]: exactly `ZImagePipeline._encode_prompt(prompts)[i]`, i.e. the valid rows
  (`hidden_states_m2[i][attention_mask[i]]`). L_i = sum of the mask row.

### `transformer.safetensors` (single item)
* `x` [16,1,8,12]: latent (C,F,H,W); 4*6 = 24 image tokens, padded to 32 inside the model.
* `t` [1]: the model's timestep input (= 1 - sigma; the model multiplies by t_scale), here 0.3.
* `cap_feats` [13,32]: caption features, 13 tokens, padded to 32 inside the model.
* `out` [16,1,8,12]: `transformer([x], t, [cap_feats], return_dict=False)[0][0]`.

### `transformer_batch2.safetensors` (two items of different lengths: exercises the batch attention mask)
`x_0` [16,1,8,8], `x_1` [16,1,8,12], `t` [2] = [0.25, 0.75], `cap_feats_0` [7,32], `cap_feats_1` [40,32]
(40 -> padded to 64 caption tokens), `out_0` [16,1,8,8], `out_1` [16,1,8,12] =
`transformer([x_0, x_1], t, [cap_feats_0, cap_feats_1])`.

### `vae.safetensors`
* `latents` [1,16,8,8] -> `decoded` [1,3,64,64] = `vae.decode(latents).sample` (raw decoder input: NO scaling/shift
  applied here; the pipeline applies `latents / 0.3611 + 0.1159` before decoding).
* `image` [1,3,64,64] uniform in [-1,1] -> `latent_mean` [1,16,8,8] = `vae.encode(image).latent_dist.mean` (= mode(),
  the first 16 channels of the encoder's 32-channel moments).

### `scheduler.json`
* `config`: the scheduler config.
* `set_timesteps`: for N in 2, 4, 8: `sigmas` (N+1 values, terminal 0) and `timesteps` (N values = sigmas*1000)
  after `set_timesteps(sigmas=linspace(1, 1/N, N), mu=...)` as the Z-Image pipeline calls it (mu is ignored because
  use_dynamic_shifting is false; the static shift 3*s/(1+2*s) is applied). Computed in float32.
* `img2img`: for N in 2, 4, 8 and strength 0.6: `t_start = int(max(N - min(N*0.6, N), 0))`, the remaining
  `timesteps` (`timesteps[t_start:]`) and `sigmas` (`sigmas[t_start:]`, with the terminal 0). The first remaining
  timestep is the one `scale_noise` uses.
* `step`: N=4, at step index 1: `prev_sample = sample + (sigma[2] - sigma[1]) * model_output` (6-element vectors).
* `scale_noise`: N=4, begin index 1: `noised = sigma[1] * noise + (1 - sigma[1]) * sample`.

### `pipeline_t2i_turbo.safetensors` (text-to-image, guidance 0, Turbo style)
`meta.json`: prompt "a red fox in the snow", negative_prompt null, height/width 64, num_inference_steps 4,
guidance_scale 0.0, max_sequence_length 32, output_type "pt".
* `latents` [1,16,8,8]: the initial noise passed as `latents=`.
* `prompt_embeds` [L,32]: `pipe.encode_prompt(prompt)` (valid rows).
* `step_latents` [4,16,8,8]: latents after each scheduler step (from `callback_on_step_end`); the last one is decoded.
* `image` [1,3,64,64]: the `output_type="pt"` result in [0,1] = `clamp(decode(latents/0.3611 + 0.1159)/2 + 0.5, 0, 1)`.

### `pipeline_t2i_cfg.safetensors` (text-to-image with classifier-free guidance)
Same as above with num_inference_steps 3, guidance_scale 4.0 and negative prompt "blurry, low quality";
adds `negative_prompt_embeds` [L',32]. The transformer runs the batch [positive, negative] (unequal caption lengths)
and `pred = pos + 4.0 * (pos - neg)`; `step_latents` is [3,16,8,8].

### `pipeline_img2img.safetensors` (`ZImageImg2ImgPipeline`, strength 0.6)
`meta.json`: prompt, 64x64, num_inference_steps 4, strength 0.6, guidance 0.0, max_sequence_length 32.
* `init_image` [1,3,64,64] in [0,1]: the `image=` argument; the pipeline's image processor maps it to `2x-1`.
* `image_latents` [1,16,8,8] = `(vae.encode(2*init_image-1).latent_dist.mean - 0.1159) * 0.3611`.
* `noise` [1,16,8,8]: the noise given to `scale_noise` (see Patches).
* `step_latents` [3,16,8,8]: 4 steps * 0.6 -> t_start 1, so 3 steps run; the initial latents are
  `scale_noise(image_latents, timesteps[1], noise)` = `sigma[1]*noise + (1-sigma[1])*image_latents`.
* `image` [1,3,64,64] in [0,1].

## Patches (randomness removed, not reproduced)
* `diffusers.models.autoencoders.vae.DiagonalGaussianDistribution.sample` is replaced by `lambda self, generator=None:
  self.mean` while the img2img golden runs, so the image latents are the encoder mean, not a sample.
* `diffusers.pipelines.z_image.pipeline_z_image_img2img.randn_tensor` is replaced by a function returning `noise`.
* The text-to-image pipelines receive their noise through `latents=`; no other random draw happens in them.
"""


if __name__ == "__main__":
    main()
