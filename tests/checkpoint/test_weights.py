"""Named weights: a safetensors file or a Hugging Face directory, read by name, only the names asked for.

The reader alone, in one process: which tensors and files it touches (a spy on safetensors'
`safe_open`), aliases of tied tensors, and each error with the values it names. Then on 2 ranks:
a name only the last stage needs fails there and every rank hears of it; and a tiny Llama saved
with `save_pretrained` in shards loads into a differently initialised copy split over two
stages, each rank reading only its stages' tensors, and trains equal to `from_pretrained` in
one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.checkpoint import weights
from plait.errors import CheckpointError
from plait.tensor_parts import RowSpan
from tests.test_import_boundary import ROOT, imports

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402 - after the importorskip


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "a.bias": torch.randn(4, generator=g),
            "b.weight": torch.randn(2, 4, generator=g), "b.running": torch.arange(2.0)}


def zeros_like(values):
    return {k: torch.zeros_like(v) for k, v in values.items()}


class Spy:
    """`safetensors.safe_open`, recording the files opened and the tensors read from them."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], []

    def __call__(self, path, framework, device="cpu"):
        self.opened.append(Path(path).name)
        handle, spy = self.real(path, framework=framework, device=device), self

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_slice(self, name):
                return handle.get_slice(name)

            def get_tensor(self, name):
                spy.read.append(name)
                return handle.get_tensor(name)

        return Handle()


@pytest.fixture
def spy(monkeypatch):
    found = Spy(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", found)
    return found


def sharded(directory: Path, values, files: dict[str, list[str]]) -> Path:
    """A Hugging Face sharded directory: each file of `files` holds the names listed for it."""
    directory.mkdir()
    for file, names in files.items():
        save_file({n: values[n] for n in names}, str(directory / file))
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, names in files.items() for n in names}}
    (directory / weights.INDEX).write_text(json.dumps(index))
    return directory


# -- reading by name -------------------------------------------------------------------------------


def test_only_the_names_asked_for_are_read_from_a_file(tmp_path, spy):
    want = tensors()
    save_file(want, str(tmp_path / "w.safetensors"))
    state = zeros_like(want)
    loaded = weights.load_weights(tmp_path / "w.safetensors", state, ["b.weight", "a.weight"])
    assert loaded.read == ["a.weight", "b.weight"] and loaded.ignored == []
    assert sorted(spy.read) == ["a.weight", "b.weight"]  # the others' bytes were never asked for
    assert torch.equal(state["a.weight"], want["a.weight"]) and torch.equal(state["b.weight"], want["b.weight"])
    assert not state["a.bias"].any() and not state["b.running"].any()


def test_zero3_rows_are_read_alone_into_the_tensor_holding_them(tmp_path, spy):
    """zero=3 (`rows`): a replica's rows of a weight are sliced from the file into its shard; the
    whole tensor is not read and the (freed) parameter itself is not written."""
    want = tensors()
    save_file(want, str(tmp_path / "w.safetensors"))
    state = zeros_like(want)
    mine = torch.zeros(2, 3, dtype=torch.float64)  # rows 2:4 of a.weight, held in another dtype
    weights.load_weights(tmp_path / "w.safetensors", state, ["a.weight", "a.bias"],
                         rows={id(state["a.weight"]): (mine, RowSpan(2, 4))})
    assert torch.equal(mine, want["a.weight"][2:4].double()) and not state["a.weight"].any()
    assert spy.read == ["a.bias"]  # a.weight was sliced, never read whole
    assert torch.equal(state["a.bias"], want["a.bias"])


def test_everything_is_read_when_nothing_is_named_and_dtypes_are_converted(tmp_path):
    want = {k: v.double() for k, v in tensors().items()}
    save_file(want, str(tmp_path / "w.safetensors"))
    state = zeros_like(tensors())  # float32
    assert weights.load_weights(tmp_path / "w.safetensors", state).read == sorted(want)  # the file's order
    for k, v in state.items():
        assert v.dtype == torch.float32 and torch.equal(v, want[k].float()), k


def test_a_sharded_directory_opens_only_the_files_holding_wanted_names(tmp_path, spy):
    want = tensors()
    directory = sharded(tmp_path / "hf", want, {"model-00001-of-00003.safetensors": ["a.weight", "a.bias"],
                                                "model-00002-of-00003.safetensors": ["b.weight"],
                                                "model-00003-of-00003.safetensors": ["b.running"]})
    assert weights.holds_weights(directory)
    assert weights.weight_map(directory)["b.weight"] == directory / "model-00002-of-00003.safetensors"
    state = zeros_like(want)
    loaded = weights.load_weights(directory, state, ["a.bias", "b.weight"])
    assert spy.opened == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
    assert spy.read == ["a.bias", "b.weight"] and loaded.read == ["a.bias", "b.weight"]
    assert [Path(f).name for f in loaded.files] == spy.opened
    assert torch.equal(state["a.bias"], want["a.bias"]) and not state["a.weight"].any()


def test_a_directory_with_one_model_safetensors(tmp_path):
    want = tensors()
    (tmp_path / "hf").mkdir()
    save_file(want, str(tmp_path / "hf" / weights.SINGLE))
    state = zeros_like(want)
    weights.load_weights(tmp_path / "hf", state, ["a.bias"])
    assert torch.equal(state["a.bias"], want["a.bias"]) and not state["a.weight"].any()


def test_a_tied_tensor_needs_one_of_its_names_in_the_file(tmp_path, spy):
    # save_pretrained writes a tied tensor once: lm_head.weight is absent, the embedding is there.
    emb = torch.zeros(3, 2)
    state = {"emb.weight": emb, "mid.weight": torch.zeros(2, 2), "head.weight": emb}
    value = torch.randn(3, 2)
    save_file({"emb.weight": value, "mid.weight": torch.ones(2, 2)}, str(tmp_path / "w.safetensors"))
    assert weights.load_weights(tmp_path / "w.safetensors", state, ["head.weight"]).read == ["emb.weight"]
    assert torch.equal(emb, value) and spy.read == ["emb.weight"]
    save_file({"mid.weight": torch.ones(2, 2), "head.weight": -value}, str(tmp_path / "head.safetensors"))
    weights.load_weights(tmp_path / "head.safetensors", state)  # saved under the other name: also fine
    assert torch.equal(emb, -value)


def test_without_the_safetensors_package_plaits_own_reader_reads_the_file(tmp_path, monkeypatch):
    want = tensors()
    save_file(want, str(tmp_path / "w.safetensors"))
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)  # import safetensors fails
    state = zeros_like(want)
    assert weights.load_weights(tmp_path / "w.safetensors", state, ["a.bias"]).read == ["a.bias"]
    assert torch.equal(state["a.bias"], want["a.bias"]) and not state["a.weight"].any()


def test_what_counts_as_weights(tmp_path):
    save_file(tensors(), str(tmp_path / "w.safetensors"))
    torch.save(tensors(), tmp_path / "w.pt")
    plait_dir = tmp_path / "ckpt"
    plait_dir.mkdir()
    (plait_dir / "latest").write_text("step-000001\n")
    save_file(tensors(), str(plait_dir / weights.SINGLE))  # plait's own layout wins
    assert [weights.holds_weights(p) for p in (tmp_path / "w.safetensors", tmp_path / "w.pt", plait_dir,
                                               tmp_path, tmp_path / "nothing")] == [True, False, False, False, False]


# -- what does not fit -----------------------------------------------------------------------------


def test_missing_names_are_listed_with_some_the_file_has(tmp_path):
    state = {f"layer.{i}.weight": torch.zeros(2) for i in range(13)}
    save_file({"layer.0.weight": torch.ones(2), "other.bias": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError) as info:
        weights.load_weights(tmp_path / "w.safetensors", state)
    assert str(info.value) == (
        f"{tmp_path / 'w.safetensors'} does not fit the model: it lacks 12 of the 13 tensors to load: "
        "layer.1.weight, layer.2.weight, layer.3.weight, layer.4.weight, layer.5.weight, layer.6.weight, "
        "layer.7.weight, layer.8.weight, layer.9.weight, layer.10.weight, ... (2 more) (the file has 2, e.g. "
        "layer.0.weight, other.bias). Load the weights saved from this architecture and size (the names of "
        "net.state_dict())")
    assert not state["layer.0.weight"].any()  # nothing is copied from weights that do not fit


def test_a_different_architecture_lists_the_files_names_too(tmp_path):
    save_file({"conv.weight": torch.ones(2), "fc.bias": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 of the 1 tensors to load: lm.weight .*; none of the "
                                              r"model's names is in it, and it has 2 the model does not: "
                                              r"conv.weight, fc.bias\. Load"):
        weights.load_weights(tmp_path / "w.safetensors", {"lm.weight": torch.zeros(2)})


def test_names_the_model_lacks_are_ignored_when_the_wanted_ones_are_there(tmp_path):
    save_file({"w": torch.ones(2), "extra": torch.ones(1)}, str(tmp_path / "w.safetensors"))
    state = {"w": torch.zeros(2)}
    assert weights.load_weights(tmp_path / "w.safetensors", state).ignored == ["extra"]
    assert state["w"].tolist() == [1.0, 1.0]


def test_shapes_that_differ_are_listed_and_nothing_is_copied(tmp_path):
    save_file({"a": torch.ones(3, 4), "b": torch.ones(2), "c": torch.ones(5)}, str(tmp_path / "w.safetensors"))
    state = {"a": torch.zeros(4, 4), "b": torch.zeros(2), "c": torch.zeros(5, 1)}
    with pytest.raises(CheckpointError, match=r"does not fit the model: 2 shapes differ: a: file \[3, 4\], "
                                              r"model \[4, 4\], c: file \[5\], model \[5, 1\]\. Load"):
        weights.load_weights(tmp_path / "w.safetensors", state)
    assert not any(t.any() for t in state.values())


@pytest.mark.parametrize("model_prefix, file_prefix, says", [
    ("model.", "", r"the model's names start with 'model.' where the file's do not \('model.a.weight' is "
                   r"'a.weight' there; 2 of the 2 would match without it\): the model wraps the one that was saved"),
    ("", "model.", r"the file's names start with 'model.' where the model's do not \('a.weight' is "
                   r"'model.a.weight' there; 2 of the 2 would match with it\): the file was saved from a module "
                   r"wrapping this one"),
])
def test_a_prefix_on_one_side_is_named(tmp_path, model_prefix, file_prefix, says):
    save_file({file_prefix + k: torch.ones(2) for k in ("a.weight", "b.weight")}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match=says):
        weights.load_weights(tmp_path / "w.safetensors", {model_prefix + k: torch.zeros(2) for k in ("a.weight", "b.weight")})


def test_a_damaged_index_or_shard_is_named(tmp_path):
    values = tensors()
    directory = sharded(tmp_path / "hf", values, {"one.safetensors": ["a.weight"], "two.safetensors": ["a.bias"]})
    index = directory / weights.INDEX
    (directory / "two.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"the index names 1 shard files that are not there: "
                                              r"two.safetensors; download or copy the whole directory"):
        weights.load_weights(directory, zeros_like(values), ["a.weight"])
    index.write_text(json.dumps({"weight_map": {"a.weight": "../one.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names files outside its directory: \['../one.safetensors'\]"):
        weights.weight_map(directory)
    index.write_text(json.dumps({"weight_map": {"a.weight": "one.safetensors", "a.bias": "one.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"the index places 1 names in files that lack them: a.bias "
                                              r"\(in one.safetensors\)"):
        weights.load_weights(directory, zeros_like(values), ["a.bias"])
    index.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"no \"weight_map\" object of name -> file name"):
        weights.weight_map(directory)
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointError, match=r"bad.safetensors: not a readable safetensors file"):
        weights.weight_map(tmp_path / "bad.safetensors")


def test_the_reader_never_talks_to_other_ranks():
    assert not {m for m in imports(ROOT / "checkpoint" / "weights.py")
                if m.startswith("torch.distributed") or m.startswith("plait.runtime")}


# -- through plait.Model ---------------------------------------------------------------------------


def test_model_load_before_build_reads_every_tensor_and_keeps_the_step(tmp_path):
    import plait
    from tests.models import mlp

    torch.manual_seed(0)
    want = {k: v + 1 for k, v in mlp().state_dict().items()}
    save_file(want, str(tmp_path / "w.safetensors"))
    model = plait.Model(mlp(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=torch.nn.MSELoss())
    assert model.load(tmp_path / "w.safetensors") == 0
    for k, v in model.net.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_model_on_the_meta_device_is_told_to_build_first(tmp_path):
    import plait
    from tests.models import mlp

    save_file(mlp().state_dict(), str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        net = mlp()
    model = plait.Model(net, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=torch.nn.MSELoss())
    with pytest.raises(CheckpointError, match=r"into a model on the meta device before it is built: call "
                                              r"model.build\(x_sample\) first"):
        model.load(tmp_path / "w.safetensors")


def load_lacking(rank, world, path):
    import plait
    from tests.models import mlp

    model = plait.Model(mlp(), plait.Config(layers_per_stage=(6, 5), num_microbatches=2, timeout_s=30.0),
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=torch.nn.MSELoss())
    model.build(torch.zeros(4, 8))
    try:
        model.load(path)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_a_name_only_the_last_stage_needs_fails_there_and_every_rank_hears_of_it(tmp_path):
    from tests.harness import run_ranks
    from tests.models import mlp

    state = mlp().state_dict()
    del state["10.weight"]  # the last Linear: only the second stage uses it
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    first, last = run_ranks(2, load_lacking, str(path), timeout=100)
    assert first == f"ranks [1] could not load the weights at {path} (see their errors); this rank loaded its share"
    assert last.startswith(f"{path} does not fit the model: it lacks 1 of the 6 tensors to load: 10.weight (the "
                           f"file has 11, e.g. 0.bias, 0.weight, 10.bias). Load the weights saved")


# -- on 2 ranks: a Hugging Face model in shards ----------------------------------------------------


BATCHES = (6, 6, 4)  # rows of the three SGD steps


def load_and_train(rank, world, directory, cut):
    """A freshly initialised Llama (another seed) on 2 stages: build, load, 3 steps; what it read."""
    import transformers

    import plait
    from tests.architectures import make

    arch = make("llama")
    torch.manual_seed(100 + rank)
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(directory))
    model = plait.Model(net, plait.Config(layers_per_stage=cut, num_microbatches=3, schedule="1f1b", timeout_s=60.0),
                        loss=arch.loss, optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    model.build(arch.x)
    recorder = Spy(safetensors.safe_open)
    safetensors.safe_open = recorder
    model.load(directory)
    losses, a = [], 0
    for rows in BATCHES:
        losses.append(model.train_on_batch({k: v[a:a + rows] for k, v in arch.x.items()}, arch.y[a:a + rows]))
        a += rows
    return losses, model.state_dict(), sorted(recorder.read), sorted(set(recorder.opened))


@pytest.mark.timeout(300)
def test_a_sharded_hugging_face_model_loads_each_ranks_share_and_trains_equal_to_one_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    from plait.capture.trace import capture_batch
    from tests.architectures import make
    from tests.harness import run_ranks
    from tests.architecture_runs import valid_cut

    arch = make("llama")  # tie_word_embeddings=True: lm_head.weight is model.embed_tokens.weight
    directory = tmp_path / "llama"
    arch.net.save_pretrained(directory, max_shard_size="20KB")
    files = json.loads((directory / weights.INDEX).read_text())["weight_map"]
    assert len(set(files.values())) > 2 and "lm_head.weight" not in files  # sharded; the tie written once
    cut = valid_cut(capture_batch(arch.net, arch.x).layers, 2)

    ref = transformers.LlamaForCausalLM.from_pretrained(directory).train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want_losses, a = [], 0
    for rows in BATCHES:
        opt.zero_grad(set_to_none=True)
        loss = arch.loss(ref(**{k: v[a:a + rows] for k, v in arch.x.items()}), arch.y[a:a + rows])
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
        a += rows

    results = run_ranks(2, load_and_train, str(directory), cut, timeout=280)
    want = ref.state_dict()
    for losses, state, _, _ in results:
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=2e-5)
        assert list(state) == list(want)
        for k in want:
            torch.testing.assert_close(state[k], want[k], rtol=1e-5, atol=2e-5, msg=k)
    (read0, opened0), (read1, opened1) = [(set(r), set(o)) for _, _, r, o in results]
    assert read0 & read1 == {"model.embed_tokens.weight"}  # the tie: the first stage's embedding, the last's head
    assert read0 | read1 == set(files)  # every tensor is read, each by the ranks that use it
    assert "model.layers.1.self_attn.q_proj.weight" in read1 - read0
    assert "model.layers.0.self_attn.q_proj.weight" in read0 - read1
    assert opened0 | opened1 == set(files.values()) and opened0 != opened1
