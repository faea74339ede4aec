// The Python module object of each per-capability CPU library (_cpu_default, _cpu_avx2,
// _cpu_avx512): importing it runs the TORCH_LIBRARY_IMPL registrations of this library.
#include <Python.h>

#define PPO_STR2(x) #x
#define PPO_STR(x) PPO_STR2(x)
#define PPO_CAT2(a, b) a##b
#define PPO_CAT(a, b) PPO_CAT2(a, b)

static struct PyModuleDef ppo_cpu_module = {PyModuleDef_HEAD_INIT, PPO_STR(TORCH_EXTENSION_NAME),
                                            "ppo_kernels CPU kernels (" PPO_STR(CPU_CAPABILITY) ")",
                                            -1, nullptr};

PyMODINIT_FUNC PPO_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&ppo_cpu_module);
}
