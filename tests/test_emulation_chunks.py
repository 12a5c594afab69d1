"""The emulator's default chunking: a scaled-down model keeps the paper's chunk count, not its size."""

from __future__ import annotations

from netstorm.config import Config
from netstorm.emulation.gloo_trainer import model_parameters
from netstorm.emulation.runner import CHUNKS_PER_MODEL, chunk_flags
from netstorm.layout import Layout, TensorSpec
from netstorm.trainers.synthetic import model_layers


def _flags(pairs: list[str]) -> dict[str, int]:
    return {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}


def test_alexnet_keeps_the_papers_chunk_and_probe_sizes() -> None:
    default = Config()
    assert _flags(chunk_flags(model_parameters("alexnet"), {})) == {
        "--chunk-size": default.chunk_size, "--probe-chunk-size": default.probe_chunk_size}


def test_a_small_model_is_cut_into_about_sixty_chunks_each_a_probe_sample() -> None:
    parameters = model_parameters("2.5M")
    flags = _flags(chunk_flags(parameters, {}))
    chunk = flags["--chunk-size"]
    assert chunk == -(-parameters // 60)
    # half a chunk's bytes, the default's ratio (2 MB probe threshold for 1 M float32 elements)
    assert flags["--probe-chunk-size"] == round(2 * chunk)
    specs = [TensorSpec(name, tuple(shape), "float32") for name, shape in model_layers("2.5M")]
    layout = Layout.build(specs, chunk)
    sizes = layout.chunk_sizes()
    assert max(sizes) <= chunk
    assert len(sizes) >= CHUNKS_PER_MODEL
    # the big chunks (the ones that carry the model) are all large enough to be throughput samples
    assert sum(s for s in sizes if 4 * s >= flags["--probe-chunk-size"]) >= 0.9 * parameters
    # the default chunk would give a handful of chunks: what the emulated runs used to get
    assert len(Layout.build(specs, Config().chunk_size).chunk_sizes()) < 10


def test_options_the_user_set_are_left_alone() -> None:
    assert chunk_flags(model_parameters("2.5M"), {"chunk_size": 5000, "probe_chunk_size": 7}) == []
    # only the chunk given: the probe threshold follows it (half its 20 000 bytes)
    assert _flags(chunk_flags(model_parameters("2.5M"), {"chunk_size": 5000})) == {"--probe-chunk-size": 10_000}


def test_a_larger_overlay_gives_every_root_sixteen_chunks() -> None:
    parameters = model_parameters("1M")
    nine = _flags(chunk_flags(parameters, {}, roots=9))["--chunk-size"]
    fifteen = _flags(chunk_flags(parameters, {}, roots=15))["--chunk-size"]
    assert nine == -(-parameters // 144)       # 16 x 9 roots beats the 60-chunk floor
    assert fifteen == -(-parameters // 240)
    assert _flags(chunk_flags(parameters, {}, roots=3))["--chunk-size"] == -(-parameters // 60)
