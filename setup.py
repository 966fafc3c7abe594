"""fairseq-plugins: five fast-translation methods for fairseq, loaded with --user-dir fairseq_plugins.

Install with `make install`, not bare pip: torch and fairseq need pinned, CPU-safe installs (see Makefile).
"""

import re

from setuptools import find_packages, setup

with open("fairseq_plugins/__init__.py", encoding="utf-8") as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

setup(
    name="fairseq-plugins",
    version=VERSION,
    description="Fast-translation methods (ByteNet, blockwise, double-token, seq-to-lattice, fast CPU "
    "decoding) as fairseq plugins",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    # The platforms of the ve-fairseq 0.12.3 wheels (cp311, cp312; manylinux_2_28_x86_64), checked by
    # scripts/check_platform.py before `make install` creates anything (tests/test_install.py keeps the two agreeing).
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["fairseq_plugins", "fairseq_plugins.*"]),
    # compiled into one library at first use (kernels/native/__init__.py)
    package_data={"fairseq_plugins.kernels.native": ["*.c", "*.h"]},
    # torch and fairseq are deliberately absent: pip would pull a CUDA torch and torchaudio for them.
    # The Makefile installs torch==2.13.0 (from TORCH_INDEX when set: PyPI's Linux build is the CUDA one) and
    # ve-fairseq==0.12.3 --no-deps, then these.
    install_requires=[
        "hydra-core>=1.3.2,<1.4",
        "omegaconf>=2.3,<2.4",
        "numpy",
        "regex",
        "sacrebleu>=2.0",
        "tqdm",
        "bitarray",
        "cffi",
        "cython",
        "scikit-learn",
        "packaging",
        "sentencepiece",
        "matplotlib",
        # `fairseq-plugins bench --reference ctranslate2` (docs/bench.md): the same-run reference users pick instead.
        "ctranslate2==4.8.5",
        'systran-align==3.5.0; platform_system == "Linux" and platform_machine == "x86_64" '
        'and python_version < "3.12"',
    ],
    # setuptools >= 70.1 builds wheels itself: tests/test_fairseq_from_source.py compiles fairseq without
    # build isolation, as `make install FAIRSEQ_FROM_SOURCE=1` does.
    extras_require={"test": ["pytest", "pytest-xdist>=3.8", "filelock", "hypothesis", "setuptools>=70.1"]},
    entry_points={"console_scripts": ["fairseq-plugins = fairseq_plugins.cli:main"]},
)
