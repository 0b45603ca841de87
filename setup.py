"""Build ringcoll: setuptools hands the extension to CMake (CMakeLists.txt), which builds
ringcoll._C with ninja, adding the CUDA sources whenever nvcc is found."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", str(ROOT), "-G", "Ninja",
            # The ninja of this build: pip builds in a fresh temporary environment each time, and a
            # cache left by an earlier `pip install .` names that one's ninja, which is gone.
            f"-DCMAKE_MAKE_PROGRAM={shutil.which('ninja') or 'ninja'}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('RINGCOLL_BUILD_TYPE', 'Release')}",
        ]
        if "RINGCOLL_CUDA_ARCHS" in os.environ:
            configure.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['RINGCOLL_CUDA_ARCHS']}")
        subprocess.run(configure, cwd=build_temp, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_temp, check=True)


setup(
    ext_modules=[CMakeExtension("ringcoll._C")],
    cmdclass={"build_ext": CMakeBuild},
)
