"""This image's generation (compiler, server versions) and NPU, as far as they can be told
without probing a device.

They matter only to judge entries by generation (cachemgr.ops.generation: incompatible,
superseded, newer): they are resolved best effort (flags, environment, package metadata; never by
probing a device), and when unknown, nothing is judged on them and a note says what to set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cachemgr.core.errors import ConfigError
from cachemgr.key.cachekey import resolve_compiler, resolve_npu
from cachemgr.key.vllm_rbln import VERSION_ENV, installed_version
from cachemgr.ops.scan import Compat

_NPU_SETTINGS = ("CACHEMGR_NPU_TYPE", "RBLN_FORCE_NPU_NAME", "RBLN_TARGET_SOC")


@dataclass(frozen=True)
class ImageInfo:
    """This image's compiler and NPU, as far as they can be told without probing a device."""

    compat: Compat
    compiler_source: str | None
    npu_source: str | None
    notes: tuple[str, ...] = ()

    def require(self) -> Compat:
        """The compiler, or a ConfigError naming what to set (``prune --incompatible``).

        The NPU type is not needed: entries for another NPU are not incompatible (scan.Compat).
        """
        if not self.compat.compiler:
            raise ConfigError(
                "prune --incompatible needs this image's RBLN Compiler version, and "
                "CACHEMGR_COMPILER_VERSION cannot be told here",
                remedy="set CACHEMGR_COMPILER_VERSION (or --compiler-version) to the version of the image whose "
                "entries are to be kept ('pip show rebel-compiler' in that image): another version's are removed",
            )
        return self.compat


def resolve_image(
    *, compiler_version: str | None, npu_type: str | None, environ: Mapping[str, str]
) -> ImageInfo:
    """Best effort, as ``key`` resolves them but never probing the device (slow, maybe absent)."""
    notes: list[str] = []
    compiler: str | None = None
    compiler_source: str | None = None
    try:
        compiler, compiler_source = resolve_compiler(compiler_version, environ)
    except ConfigError as error:
        notes.append(
            f"this image's RBLN Compiler version is unknown ({error.what}): entries are not judged "
            "by compiler; set CACHEMGR_COMPILER_VERSION to mark those for other versions incompatible"
        )
    npu: str | None = None
    npu_source: str | None = None
    try:
        npu, npu_source = resolve_npu(npu_type, environ, probe=False)
    except ConfigError as error:
        unset = not (npu_type or any(environ.get(name, "").strip() for name in _NPU_SETTINGS))
        notes.append(
            "this pod's NPU type is unknown (inspection never probes the device): entries for other NPUs "
            "are not told apart; set CACHEMGR_NPU_TYPE or RBLN_FORCE_NPU_NAME to see them"
            if unset
            else f"this pod's NPU type is unusable ({error.what}); entries are not judged by NPU"
        )
    versions = server_versions(environ)
    return ImageInfo(Compat(compiler, npu, versions or None), compiler_source, npu_source, tuple(notes))


def server_versions(environ: Mapping[str, str]) -> dict[str, str]:
    """The server's versions this image has, each as the key reads it (its variable, else the
    installed package), those that can be told: an image without the server has none, and then
    entries are judged by compiler and key schema alone."""
    found: dict[str, str] = {}
    for part, (dist, env) in VERSION_ENV.items():
        given = environ.get(env, "").strip()
        if given:
            found[part] = given
            continue
        try:
            found[part] = installed_version(dist)
        except LookupError:
            continue
    return found
