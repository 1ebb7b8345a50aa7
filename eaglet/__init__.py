# Before anything loads torch: idle OpenMP threads sleep instead of spinning (see cpu_threads).
from eaglet.cpu_threads import quiet_openmp

quiet_openmp()
