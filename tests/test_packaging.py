"""The distribution as a user installs it without the repository (`pip install .`, a wheel): every package and every
Hydra config is in the wheel, and the installed commands find their configs."""
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("decode", "distill", "quickstart")


def _listed_packages() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_the_package_list_names_every_package_and_config_group():
    found = {".".join(p.parent.relative_to(REPO).parts) for top in PACKAGES for p in (REPO / top).rglob("__init__.py")}
    groups = {"distill.conf"} | {f"distill.conf.{d.name}" for d in (REPO / "conf").iterdir() if d.is_dir()}
    assert sorted(_listed_packages()) == sorted(found | groups), "pyproject.toml [tool.setuptools] packages"


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"  # a copy: a build in the repository would leave build/ and egg-info there
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    ignore = shutil.ignore_patterns("__pycache__")
    for folder in (*PACKAGES, "conf"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return next((tmp_path / "dist").glob("draftkit-*.whl"))


def test_an_installed_wheel_has_the_configs_and_its_commands_find_them(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (REPO / "conf").rglob("*.yaml"):
        assert f"distill/conf/{path.relative_to(REPO / 'conf').as_posix()}" in names
    for top in PACKAGES:
        for path in (REPO / top).rglob("*.py"):
            assert path.relative_to(REPO).as_posix() in names

    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    work = tmp_path / "work"  # not the repository: nothing may come from it
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DRAFTKIT_CONF", "DRAFTKIT_SHARED_DATA")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    probe = ("import distill, quickstart.run as q; from distill.config import conf_dir; "
             "from decode.prompts import shared_data_dir; print(distill.__file__, conf_dir(), q.in_checkout(), "
             "q.load_settings('quickstart').target.budget_s, shared_data_dir())")
    r = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    module, conf, in_checkout, budget, shared = r.stdout.split()
    assert Path(module).is_relative_to(site) and Path(conf) == site / "distill" / "conf"
    assert in_checkout == "False" and float(budget) > 0
    assert Path(shared) == tmp_path / "shared" / "data"  # ../shared/data from the current folder, not site-packages
    r = subprocess.run([sys.executable, "-m", "distill", "train", "+experiment=quickstart", "--cfg", "job"], cwd=work,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "max_time_s: 300" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "distill", "train", "train.max_steps=abc"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "train.max_steps=abc: expected an integer" in r.stderr, r.stderr
