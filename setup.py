"""The one compiled part of kpx, optional: the relay core (proxy/userspace/_relaycore.c).

Everything else is in pyproject.toml. ``optional=True``: where it cannot be built
(no C compiler, no Python headers) ``pip install`` still succeeds, and kpx runs its
pure-Python relay (``proxy.userspace.corefwd``), as aiohttp does with its extensions.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.userspace._relaycore",
            ["proxy/userspace/_relaycore.c"],
            extra_compile_args=["-O2", "-Wall", "-Wno-missing-field-initializers"],
            optional=True,
        ),
    ],
)
