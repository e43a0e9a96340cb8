"""Coverage-guided fuzzing (atheris: libFuzzer for Python) of one target of tests/fuzz/targets.py.

Usage::

    python tests/fuzz/atheris_main.py TARGET [--seed-corpus DIR] [libFuzzer flags] [CORPUS_DIR ...]

``--seed-corpus DIR`` writes the target's seed inputs (valid payloads, headers, envelopes) into
DIR and fuzzes with DIR as the corpus.

TARGET is ``payload``, ``header`` or ``envelope``. ``nemo_dcr`` is instrumented (edge coverage of
its Python code); numpy, zstandard and the numba-compiled kernels run uninstrumented (the kernels
are compiled, or loaded from their cache, before fuzzing starts). A :class:`targets.SilentChange`
or any other exception ends the run as a crash (libFuzzer writes the input to ``crash-*``); an
input running past ``-timeout`` seconds ends it as a hang. ``benchmarks/fuzz.py`` runs every
target for a number of inputs and reports the figures; ``tests/fuzz/test_atheris_smoke.py`` runs
a few thousand inputs of each in CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# numba compiles its kernels from their bytecode: instrumented bytecode does not compile, so the
# compiled-kernel modules run uninstrumented (their Python callers are instrumented).
NUMBA_MODULES = ["nemo_dcr.codec.dcr.jit_bits", "nemo_dcr.codec.dcr.jit_decode", "nemo_dcr.codec.dcr.jit_encode",
                 "nemo_dcr.codec.dcr.jit_index", "nemo_dcr.kernels.cpu", "nemo_dcr.kernels.jit",
                 "nemo_dcr.verify.checksum"]

with atheris.instrument_imports(include=["nemo_dcr"], exclude=NUMBA_MODULES):
    import nemo_dcr.codec  # noqa: F401
    import nemo_dcr.codec.header  # noqa: F401
    import nemo_dcr.transport.store  # noqa: F401

from nemo_dcr.codec.warm import warm  # noqa: E402
from tests.fuzz import targets  # noqa: E402


def write_seeds(name: str, folder: Path) -> int:
    """Write the target's seed inputs into ``folder``; returns how many."""
    folder.mkdir(parents=True, exist_ok=True)
    seeds = targets.TARGETS[name][1]()
    for i, s in enumerate(seeds):
        (folder / f"seed-{i:03d}").write_bytes(s)
    return len(seeds)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in targets.TARGETS:
        raise SystemExit(f"usage: {argv[0]} {{{','.join(targets.TARGETS)}}} [--seed-corpus DIR] [libFuzzer args]")
    name, rest = argv[1], argv[2:]
    if "--seed-corpus" in rest:
        i = rest.index("--seed-corpus")
        folder = rest[i + 1]
        write_seeds(name, Path(folder))
        rest = rest[:i] + rest[i + 2:] + [folder]
    run = targets.TARGETS[name][0]
    warm()  # compile (or load) the kernels first: a first-use compile would count as a hang
    atheris.Setup([argv[0]] + rest, lambda data: run(data))
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
