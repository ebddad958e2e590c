"""The model against Hugging Face transformers and peft, parameter counts, the K/V cache, and bad inputs."""

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, hub_names, make_hf_model, save_old_style
from load_pythia import load_pythia, load_tokenizer, skeleton
from model import CPU_BF16_EXPLICIT_MAX, GPT, GPTConfig, KVCache, attention

PARITY_TOL = 1e-4  # max |logits difference| against transformers, fp32
SWITCH_TOL = 0.05  # max |logits difference| right after switching on preproj + skip (inits 0.01 / 1e-4)


def batch(vocab=512, B=3, T=17, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rotary_pct,parallel,fmt", [
    (0.25, True, "safetensors"), (1.0, True, "safetensors"), (0.25, False, "safetensors"),
    (1.0, False, "bin"), (0.25, True, "bin"),
])
def test_logit_parity_with_transformers(tmp_path, rotary_pct, parallel, fmt):
    hf = make_hf_model(rotary_pct=rotary_pct, parallel=parallel)
    folder = tmp_path / "ckpt"
    hf.save_pretrained(folder) if fmt == "safetensors" else save_old_style(hf, folder)
    ours = load_pythia(str(folder))
    assert ours.config.rotary_pct == rotary_pct and ours.config.parallel_residual == parallel
    x = batch()
    with torch.no_grad():
        diff = (ours(x)[0] - hf(x).logits).abs().max().item()
    print(f"rotary_pct={rotary_pct} parallel={parallel} {fmt}: max |dlogits| = {diff:.2e}")
    assert diff <= PARITY_TOL


def test_switches_start_near_the_base(tiny_hf_dir):
    x = batch()
    base = load_pythia(tiny_hf_dir)
    torch.manual_seed(0)
    new = load_pythia(tiny_hf_dir, preproj=True, skip=True)
    with torch.no_grad():
        diff = (new(x)[0] - base(x)[0]).abs().max().item()
    assert 0 < diff <= SWITCH_TOL
    # the base weights are untouched by the switches
    for k, v in base.state_dict().items():
        assert torch.equal(v, new.state_dict()[k])


def test_loss_and_gradients_match_transformers(tiny_hf_dir):
    """Training through our chunked loss gives transformers' loss and gradients (ignored labels included)."""
    from transformers import GPTNeoXForCausalLM

    hf = GPTNeoXForCausalLM.from_pretrained(tiny_hf_dir, attn_implementation="eager")
    ours = load_pythia(tiny_hf_dir)
    x = batch()
    labels = x.clone()
    labels[0, 5:9] = -100
    hf_loss = hf(input_ids=x, labels=labels).loss
    _, loss = ours(x[:, :-1], labels[:, 1:])
    hf_loss.backward()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) < 1e-5
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    for name, hf_name in (("lm_head.weight", "embed_out.weight"), ("wte.weight", "gpt_neox.embed_in.weight"),
                          ("blocks.0.attn.qkv.weight", "gpt_neox.layers.0.attention.query_key_value.weight")):
        hf_grad = hf_grads.get(hf_name, hf_grads.get(name))
        assert (dict(ours.named_parameters())[name].grad - hf_grad).abs().max().item() < 1e-5, name


def test_switches_combine_independently():
    torch.manual_seed(0)
    x = batch(vocab=128)
    for preproj in (False, True):
        for skip in (False, True):
            for r in (0, 4):
                cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32,
                                preproj=preproj, skip=skip, lora_rank=r)
                m = GPT(cfg)
                logits, no_loss = m(x)
                same_logits, loss = m(x, x)
                assert logits.shape == (3, 17, 128) and no_loss is None and torch.equal(same_logits, logits)
                assert torch.isfinite(loss)
                assert (m.blocks[0].w_up is not None) == preproj and (m.blocks[0].w_skip is not None) == skip


def test_skip_without_preproj_reads_x_hat():
    """With skip alone, W_skip reads the layer-norm output: out = x + attn(x_hat) + W_skip x_hat + mlp."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, skip=True)
    m = GPT(cfg).eval()
    with torch.no_grad():
        m.blocks[0].w_skip.weight.copy_(torch.eye(16))
        x = m.wte(batch(vocab=64, B=1, T=5))
        cos, sin = m.rotary(0, 5, x.dtype)
        blk = m.blocks[0]
        x_hat = blk.ln_1(x)
        expected = x + blk.attn(x_hat, cos, sin) + x_hat + blk.mlp(blk.ln_2(x))
        assert torch.allclose(blk(x, cos, sin), expected, atol=1e-6)


def test_linear_preproj_drops_only_the_silu():
    """The linear control: x_tilde = x_hat + W_down W_up x_hat, with the pre-projection's parameters and
    initialisation; the plain pre-projection on the same weights differs (its SiLU)."""
    shape = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, preproj=True, skip=True)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**shape))
    torch.manual_seed(0)
    linear = GPT(GPTConfig(**shape, preproj_linear=True))
    assert linear.num_params("new") == plain.num_params("new")
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), linear.state_dict().values()))
    blk = linear.blocks[0]
    x_hat = torch.randn(2, 5, 16)
    expected = x_hat + x_hat @ blk.w_up.weight.T @ blk.w_down.weight.T
    with torch.no_grad():
        assert torch.allclose(blk.pre_projection(x_hat), expected, atol=1e-6)
        assert not torch.allclose(plain.blocks[0].pre_projection(x_hat), expected, atol=1e-6)
    with pytest.raises(ValueError, match="needs preproj=True"):
        GPTConfig(preproj_linear=True)


@pytest.mark.parametrize("name,layers,heads,d,base,new", [
    ("pythia-160m", 12, 12, 768, 162_322_944, 24_772_608),
    ("pythia-410m", 24, 16, 1024, 405_334_016, 88_080_384),
])
def test_parameter_counts_from_config(name, layers, heads, d, base, new):
    cfg = GPTConfig(vocab_size=50304, n_layer=layers, n_head=heads, n_embd=d, preproj=True, skip=True)
    with torch.device("meta"):  # counts from the config alone, no memory
        m = GPT(cfg)
    assert m.num_params("base") == base
    assert m.num_params("new") == new
    assert m.num_params("all") == base + new
    m.freeze_base()
    assert m.num_params("trainable") == new


def test_lora_parity_with_peft():
    from peft import LoraConfig, get_peft_model

    hf = make_hf_model()
    r, alpha = 4, 8
    peft_model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=["query_key_value", "dense"],
                                               lora_dropout=0.0, init_lora_weights=False)).eval()
    ours = GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=64, lora_rank=r,
                         lora_alpha=alpha)).eval()
    from load_pythia import map_state_dict
    base = hub_names({k.replace("base_model.model.", "").replace(".base_layer", ""): v
                      for k, v in peft_model.state_dict().items() if "lora_" not in k})
    state = map_state_dict(base, ours.base_state_dict())
    for i in range(2):
        for hf_name, our_name in (("query_key_value", "qkv"), ("dense", "proj")):
            pre = f"base_model.model.gpt_neox.layers.{i}.attention.{hf_name}"
            state[f"blocks.{i}.attn.{our_name}.lora_a"] = peft_model.state_dict()[f"{pre}.lora_A.default.weight"]
            state[f"blocks.{i}.attn.{our_name}.lora_b"] = peft_model.state_dict()[f"{pre}.lora_B.default.weight"]
    ours.load_state_dict(state)
    assert ours.num_params("new") == sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    x = batch()
    with torch.no_grad():
        diff = (ours(x)[0] - peft_model(x).logits).abs().max().item()
    assert diff <= PARITY_TOL
    with torch.no_grad():  # and LoRA really does something (B is not zero here)
        ours_off = GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=64)).eval()
        ours_off.load_state_dict(ours.base_state_dict())
        assert (ours(x)[0] - ours_off(x)[0]).abs().max() > 1e-3


@pytest.mark.parametrize("preproj,skip", [(False, False), (True, True)])
def test_kv_cache_generation_matches_full_recompute(preproj, skip):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=32, preproj=preproj, skip=skip)
    m = GPT(cfg).eval()
    if skip:  # make the switches matter
        for b in m.blocks:
            torch.nn.init.normal_(b.w_skip.weight, std=0.1)
    prompt = batch(vocab=128, B=2, T=7)
    with_cache = m.generate(prompt, 20, temperature=0, use_cache=True)
    without = m.generate(prompt, 20, temperature=0, use_cache=False)
    assert torch.equal(with_cache, without)
    # logits: prefill then one token at a time with the cache == one pass over the whole sequence
    cache = KVCache(cfg, 2, 27, "cpu", torch.float32)
    with torch.no_grad():
        first, _ = m(with_cache[:, :7], cache=cache)
        steps = [first] + [m(with_cache[:, t:t + 1], cache=cache)[0] for t in range(7, 27)]
        full, _ = m(with_cache)
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5
    # a chunk of several tokens after a prefill also works (mask with an offset)
    cache = KVCache(cfg, 2, 27, "cpu", torch.float32)
    with torch.no_grad():
        m(with_cache[:, :7], cache=cache)
        chunk, _ = m(with_cache[:, 7:15], cache=cache)
    assert (chunk - full[:, 7:15]).abs().max() < 1e-5


@pytest.mark.parametrize("T", [40, CPU_BF16_EXPLICIT_MAX + 8])  # written out in bf16 on a CPU / the fused kernel
def test_bf16_attention_matches_fp32(T):
    """attention() in bf16 against PyTorch's fused kernel in fp32 on the same inputs: causal over the whole window,
    and the K/V cache's case (the last 10 queries over every key), outputs and input gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, T, 64) for _ in range(3))
    cache_mask = torch.ones(10, T, dtype=torch.bool).tril(T - 10)
    for mask, rows in ((None, slice(None)), (cache_mask, slice(T - 10, None))):
        ins32 = [t.clone().requires_grad_() for t in (q[:, :, rows], k, v)]
        ins16 = [t.bfloat16().requires_grad_() for t in (q[:, :, rows], k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*ins32, attn_mask=mask, is_causal=mask is None)
        out = attention(*ins16)  # causal, with the queries as the last positions
        assert out.dtype == torch.bfloat16
        assert (out.float() - ref).abs().max() < 0.03  # bf16 rounding (a wrong mask is off by ~0.5)
        grad = torch.randn_like(ref)
        ref.backward(grad)
        out.backward(grad.bfloat16())
        for a, b in zip(ins16, ins32):
            assert (a.grad.float() - b.grad).abs().max() < 0.05 * b.grad.abs().max()


def test_kv_cache_holds_the_same_k_and_v_shapes_with_switches_on():
    """The K and V the model writes into its cache have the same shapes, dtype and bytes with pre-projection and
    skip on as off (they change what K and V are computed from, not their size); with the switches on the values
    differ from the baseline's, and cached generation equals uncached (checked above)."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=3, n_head=4, n_embd=32)).eval()
    switched = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=3, n_head=4, n_embd=32, preproj=True,
                             skip=True)).eval()
    switched.load_state_dict(base.state_dict(), strict=False)
    for b in switched.blocks:  # a pre-projection far from the identity, so that K and V change
        torch.nn.init.normal_(b.w_up.weight, std=0.3)
        torch.nn.init.normal_(b.w_down.weight, std=0.3)
    prompt = batch(vocab=128, B=2, T=10)
    caches = []
    for m in (base, switched):
        cache = KVCache(m.config, 2, 10, "cpu", torch.float32)
        with torch.no_grad():
            m(prompt, cache=cache)
        assert cache.pos == 10 and cache.k.abs().sum() > 0 and cache.v.abs().sum() > 0  # really written
        caches.append(cache)
    (k0, v0), (k1, v1) = [(c.k, c.v) for c in caches]
    assert k0.shape == k1.shape == (3, 2, 4, 10, 8) and v0.shape == v1.shape and k0.dtype == k1.dtype
    assert caches[0].nbytes() == caches[1].nbytes() == 2 * k0.numel() * 4
    assert (k0 - k1).abs().max() > 1e-3 and (v0 - v1).abs().max() > 1e-3  # computed from x_tilde, not x_hat


def test_pythia_tokenizer_known_ids(mirror):
    tok = load_tokenizer(os.path.join(mirror, "tokenizers", "20B_tokenizer.json"))
    assert tok.encode("Hello world").ids == [12092, 1533]
    assert tok.encode(" leading space").ids == [4283, 2317]
    assert tok.get_vocab_size() == 50277


# --- bad inputs ---

def test_loading_draws_only_the_new_weights(tiny_hf_dir, monkeypatch):
    """A Hugging Face checkpoint's base weights are assigned, not first drawn at random and then overwritten (time
    wasted at 410M): only the switches' new parameters are drawn, and a seed gives the same ones every time."""
    drawn = []
    real = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda t, *a, **k: drawn.append(0 if t.is_meta else t.numel()) or
                        real(t, *a, **k))
    torch.manual_seed(3)
    model = load_pythia(tiny_hf_dir, preproj=True, skip=True)
    assert sum(drawn) == model.num_params("new") > 0
    torch.manual_seed(3)
    again = load_pythia(tiny_hf_dir, preproj=True, skip=True)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert not any(p.is_meta for p in model.parameters())


def test_the_skeleton_is_the_model_on_the_meta_device_and_imports_no_compiler(tiny_hf_dir):
    """load_pythia.skeleton is GPT(config) built on the meta device with its draws skipped: the same parameters
    (names, shapes, dtypes, trainability). A process that loads a Pythia folder and counts a run's memory (the dry
    run) never imports torch._dynamo, which the first draw on a meta tensor would, seconds before any work."""
    def described(model: GPT) -> list:
        return [(n, p.shape, p.dtype, p.requires_grad, p.is_meta) for n, p in model.named_parameters()]

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, preproj=True, skip=True,
                       adapter_dim=8, lora_rank=4)
    with torch.device("meta"):
        plain = GPT(config)
    assert described(skeleton(config)) == described(plain)
    code = ("import sys; from load_pythia import load_pythia; from lab.memory import meta_model; "
            "model = load_pythia(sys.argv[1], preproj=True, skip=True); meta_model(model.config, probe=True); "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, tiny_hf_dir], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_non_gpt_neox_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        load_pythia(str(tmp_path))


def test_missing_weight_file(tmp_path, tiny_hf_dir):
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_hf_dir, "config.json")).read())
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        load_pythia(str(tmp_path))


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_state_dict_mismatch(tmp_path, change):
    hf = make_hf_model()
    state = hub_names(hf.state_dict())
    if change == "extra":
        state["gpt_neox.layers.0.attention.surprise.weight"] = torch.zeros(2)
    else:
        del state["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"]
    hf.save_pretrained(tmp_path)
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    expected = "surprise" if change == "extra" else "blocks.1.mlp.proj.bias"
    with pytest.raises(ValueError, match=expected):
        load_pythia(str(tmp_path))


def test_prompt_longer_than_block_size():
    m = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        m.generate(torch.zeros(1, 17, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="longer than block_size=16"):
        m(torch.zeros(1, 17, dtype=torch.long))


# --- the loader's place, and generation from a Hugging Face folder (sample.py) ---

def test_loader_imports_only_model_and_data():
    """load_pythia.py sits below the library (lab/) and above the model: it imports no lab module and no tool."""
    tree = ast.parse(open(os.path.join(ROOT, "load_pythia.py")).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    ours = {name.split(".")[0] for name in imported} & {"lab", "tools", "study", "train", "sample", "eval_lambada"}
    assert not ours and {"model", "data.sources"} <= imported, imported


def test_sample_generates_from_a_hugging_face_folder(tmp_path, mirror):
    """sample.py on a folder written by transformers' save_pretrained: greedy text equals transformers' own greedy
    continuation; without a tokenizer.json beside the weights it takes Pythia's from the mirror."""
    tok_file = os.path.join(mirror, "tokenizers", "20B_tokenizer.json")
    hf = make_hf_model(vocab=50304, d=64, max_pos=64)
    hf.save_pretrained(tmp_path / "bare")
    shutil.copytree(tmp_path / "bare", tmp_path / "hf")
    shutil.copy(tok_file, tmp_path / "hf" / "tokenizer.json")
    tok = load_tokenizer(tok_file)
    ids = tok.encode("Hello world").ids
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))

    def sample(folder, *flags):
        return subprocess.run([sys.executable, "sample.py", "--init_from", str(folder), "--prompt", "Hello world",
                               "--max_new_tokens", "5", "--device", "cpu", "--dtype", "float32", "--mirror", mirror,
                               *flags], cwd=ROOT, capture_output=True, text=True)

    proc = sample(tmp_path / "hf", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"--- sample 1 of 1 ({tmp_path / 'hf'}) ---\n{tok.decode(ids)}\n\n"
    proc = sample(tmp_path / "bare", "--preproj", "--skip")  # no tokenizer.json: Pythia's, from the mirror
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.split(" ---\n", 1)[1].removesuffix("\n\n")
    assert text.startswith("Hello world") and len(text) > len("Hello world")
