import re

from setuptools import find_packages, setup

SERVE = ["tensorflow-text>=2.21,<2.22", "ctranslate2>=4"]
# The peer the speed benchmarks compare with.
BENCH = ["keras-hub"]

setup(
    name="kyu_transformer",
    version=re.search(r'__version__ = "(.+)"', open("kyu_transformer/__init__.py").read())[1],
    description=("A readable Transformer for Keras 3 / TensorFlow 2, ported from Kyubyong Park's "
                 "modules.py."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["kyu_transformer", "kyu_transformer.*"]),
    python_requires=">=3.9",
    install_requires=[
        "tensorflow>=2.16",
        "tensorboard",
        "keras>=3",
        "numpy",
        "sentencepiece",
        "sacrebleu>=2",
        "matplotlib",
    ],
    extras_require={
        # Serving exports (export.py): tensorflow-text's ops are built for one
        # TensorFlow minor version, the one installed here (2.21).
        "serve": SERVE,
        # The tests cover the exports and the benchmarks' comparison with their peer
        # too, run the layers on JAX, and run on two processes at once (pytest-xdist).
        "test": ["pytest", "pytest-xdist", "jax", *SERVE, *BENCH],
        "bench": BENCH,
    },
)
