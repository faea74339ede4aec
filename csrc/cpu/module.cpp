// The Python module object of each per-capability CPU library (_cpu_default, _cpu_avx2,
// _cpu_avx512): importing it runs the TORCH_LIBRARY_IMPL registrations of this library.
// Its one function, empty_cache(), returns the recycled gradient buffer (grad_buffer.h).
#include <Python.h>

#include "grad_buffer.h"

#define PPO_STR2(x) #x
#define PPO_STR(x) PPO_STR2(x)
#define PPO_CAT2(a, b) a##b
#define PPO_CAT(a, b) PPO_CAT2(a, b)

static PyObject* empty_cache(PyObject*, PyObject*) {
  ppo_cpu::GradCache::get().empty();
  Py_RETURN_NONE;
}

static PyMethodDef ppo_cpu_methods[] = {
    {"empty_cache", empty_cache, METH_NOARGS,
     "Return the recycled CPU gradient buffer to the operating system."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef ppo_cpu_module = {PyModuleDef_HEAD_INIT, PPO_STR(TORCH_EXTENSION_NAME),
                                            "ppo_kernels CPU kernels (" PPO_STR(CPU_CAPABILITY) ")",
                                            -1, ppo_cpu_methods};

PyMODINIT_FUNC PPO_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&ppo_cpu_module);
}
