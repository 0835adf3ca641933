from setuptools import setup
from Cython.Build import cythonize
mods = ["ssdtrain/engine/hooks.py", "ssdtrain/engine/group.py", "ssdtrain/engine/ref.py", "ssdtrain/engine/cache.py",
        "ssdtrain/engine/writer.py", "ssdtrain/engine/reader.py", "ssdtrain/engine/schedule.py", "ssdtrain/engine/stats.py",
        "ssdtrain/engine/small.py", "ssdtrain/engine/views.py", "ssdtrain/host/copy_clock.py", "ssdtrain/host/host_pool.py",
        "ssdtrain/host/tier.py", "ssdtrain/engine/peak.py", "ssdtrain/store/allocator.py"]
setup(ext_modules=cythonize(mods, compiler_directives={"language_level": 3, "binding": True}, nthreads=2, quiet=True),
      script_args=["build_ext", "--inplace"])
