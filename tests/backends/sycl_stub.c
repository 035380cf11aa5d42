/*
 * Stand-in for bigdl-core-cpp's libollama-ggml-sycl.so (the Ollama 0.5.4 build inside the PyPI
 * wheel bigdl-core-cpp==2.6.0). The real library needs Intel's SYCL runtime and an Intel GPU and
 * aborts without one. tests/backends/install.sh compiles this file with gcc and puts it in place
 * of the real library; ggml then finds no SYCL backend and runs everything on its CPU backend.
 *
 * It defines exactly the symbols that the other libraries in the wheel import from the real one
 * (`nm -D --undefined-only` on libollama_ggml.so, libollama_llama.so, libollama_llava_shared.so):
 *   ggml_backend_sycl_reg               libollama_ggml.so: backend registry; NULL = no SYCL backend
 *   ggml_backend_sycl_init              libollama_llava_shared.so
 *   ggml_backend_sycl_get_device_name   libollama_llama.so
 *   ggml_format_convert_to_xpu          libollama_llama.so (a C++ function: exported by its
 *                                       mangled name, _Z26ggml_format_convert_to_xpuPKvPvmi)
 * Signatures follow ggml-sycl.h of that llama.cpp version; opaque pointer types are void *.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

/* ggml_backend_reg_t ggml_backend_sycl_reg(void); */
EXPORT void *ggml_backend_sycl_reg(void) { return NULL; }

/* ggml_backend_t ggml_backend_sycl_init(int device); */
EXPORT void *ggml_backend_sycl_init(int device) {
    (void)device;
    return NULL;
}

/* void ggml_backend_sycl_get_device_name(int device, char *description, size_t description_size); */
EXPORT void ggml_backend_sycl_get_device_name(int device, char *description, size_t description_size) {
    (void)device;
    if (description != NULL && description_size > 0) {
        strncpy(description, "none", description_size - 1);
        description[description_size - 1] = '\0';
    }
}

/* void ggml_format_convert_to_xpu(const void *src, void *dst, size_t n, int type);
 * Only reached for tensors in a SYCL (XPU) buffer, which cannot exist without the backend. */
EXPORT void _Z26ggml_format_convert_to_xpuPKvPvmi(const void *src, void *dst, size_t n, int type) {
    (void)src;
    (void)dst;
    (void)n;
    (void)type;
    fputs("sycl_stub: ggml_format_convert_to_xpu called without a SYCL backend\n", stderr);
    abort();
}
