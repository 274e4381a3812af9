/* A stand-in libcuda.so.1 for timing gpumem's CuPy hook on a machine without a GPU
 * (benchmarks/cupy_hook_cpu/run.py builds it and puts it on LD_LIBRARY_PATH of a child process).
 *
 * It answers the 29 driver entry points gpumem's CudaBackend loads, for one device with VMM, and
 * touches no memory: address ranges are numbers handed out in order, events are always complete.
 * A context is current from the first cuDevicePrimaryCtxRetain on (as CuPy's cudaSetDevice makes
 * it), so the hook finds its device from the current context, as on a GPU. The calls cost a few
 * instructions, not a real driver's: the harness measures the hook's own work around them.
 */
#include <stddef.h>

typedef int CUresult;
static char g_ctx;                      /* the one context */
static void* g_current = 0;             /* the current context */
static unsigned long long g_next_va = 1ull << 40;
static unsigned long long g_next_handle = 1;
static char g_event;

CUresult cuInit(unsigned flags) { (void)flags; return 0; }
CUresult cuGetErrorName(CUresult r, const char** s) { (void)r; *s = "CUDA_ERROR_FAKE"; return 0; }
CUresult cuDeviceGet(int* d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, int d) { (void)attr; (void)d; *v = 1; return 0; }
CUresult cuDeviceCanAccessPeer(int* c, int a, int b) { (void)a; (void)b; *c = 0; return 0; }
CUresult cuDeviceTotalMem_v2(size_t* t, int d) { (void)d; *t = 141ull << 30; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { (void)d; *c = &g_ctx; g_current = &g_ctx; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = g_current; return 0; }
CUresult cuCtxGetDevice(int* d) { if (!g_current) return 201; *d = 0; return 0; }
CUresult cuCtxPushCurrent_v2(void* c) { g_current = c; return 0; }
CUresult cuCtxPopCurrent_v2(void** c) { if (c) *c = g_current; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t* f, size_t* t) { *f = 140ull << 30; *t = 141ull << 30; return 0; }
CUresult cuMemAddressReserve(unsigned long long* va, size_t n, size_t align, unsigned long long addr,
                             unsigned long long flags) {
    (void)addr; (void)flags;
    if (align < (2u << 20)) align = 2u << 20;
    g_next_va = (g_next_va + align - 1) / align * align;
    *va = g_next_va;
    g_next_va += n;
    return 0;
}
CUresult cuMemAddressFree(unsigned long long va, size_t n) { (void)va; (void)n; return 0; }
CUresult cuMemCreate(unsigned long long* h, size_t n, const void* prop, unsigned long long flags) {
    (void)n; (void)prop; (void)flags; *h = g_next_handle++; return 0;
}
CUresult cuMemRelease(unsigned long long h) { (void)h; return 0; }
CUresult cuMemMap(unsigned long long va, size_t n, size_t off, unsigned long long h, unsigned long long f) {
    (void)va; (void)n; (void)off; (void)h; (void)f; return 0;
}
CUresult cuMemUnmap(unsigned long long va, size_t n) { (void)va; (void)n; return 0; }
CUresult cuMemSetAccess(unsigned long long va, size_t n, const void* desc, size_t count) {
    (void)va; (void)n; (void)desc; (void)count; return 0;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const void* prop, int option) {
    (void)prop; (void)option; *g = 2u << 20; return 0;
}
CUresult cuEventCreate(void** e, unsigned flags) { (void)flags; *e = &g_event; return 0; }
CUresult cuEventRecord(void* e, void* s) { (void)e; (void)s; return 0; }
CUresult cuEventQuery(void* e) { (void)e; return 0; }
CUresult cuEventSynchronize(void* e) { (void)e; return 0; }
CUresult cuEventDestroy_v2(void* e) { (void)e; return 0; }
CUresult cuStreamSynchronize(void* s) { (void)s; return 0; }
CUresult cuStreamWaitEvent(void* s, void* e, unsigned flags) { (void)s; (void)e; (void)flags; return 0; }
