"""The package's layout: every folder of modules is a package that setup.py installs, and no
module imports a program at the top of the repository."""

import ast
import os

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "kyu_transformer")
PROGRAMS = {"train", "eval", "export", "import_tf1", "hparams"}


def module_paths():
    """Yields the path of every Python module of the package."""
    for directory, _, files in os.walk(PACKAGE):
        if "__pycache__" not in directory:
            yield from (os.path.join(directory, name) for name in files if name.endswith(".py"))


def test_every_folder_of_modules_is_an_installed_package():
    folders = {os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")
               for path in module_paths()}
    installed = set(setuptools.find_packages(ROOT, include=["kyu_transformer",
                                                            "kyu_transformer.*"]))
    assert folders == installed


def test_no_module_imports_a_program():
    importing = []
    for path in module_paths():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            importing += [f"{os.path.relpath(path, ROOT)}: {name}" for name in names
                          if name.split(".")[0] in PROGRAMS]
    assert not importing
