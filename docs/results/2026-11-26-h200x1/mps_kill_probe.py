"""Under MPS, does a process killed while its kernel spins on host-mapped pinned memory fault the OTHER
clients? A: cudaHostAlloc(Mapped). B: a /dev/shm mapping registered with cudaHostRegister(Mapped).
C: device memory only (control)."""
import os, sys, time, signal, subprocess, json, mmap
import cupy as cp
SPIN = cp.RawKernel(r'''
extern "C" __global__ void spin(volatile unsigned* p, int n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    for (;;) { p[i % n] += 1; __threadfence_system(); }
}''', "spin")
N = 1 << 20

def victim(kind):
    if kind == "hostalloc":
        h = cp.cuda.runtime.hostAlloc(N * 4, cp.cuda.runtime.hostAllocMapped | cp.cuda.runtime.hostAllocPortable)
        d = cp.cuda.runtime.hostGetDevicePointer(h, 0)
    elif kind == "shm":
        fd = os.open(f"/dev/shm/probe3_{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, N * 4)
        m = mmap.mmap(fd, N * 4)
        import ctypes
        h = ctypes.addressof(ctypes.c_char.from_buffer(m))
        cp.cuda.runtime.hostRegister(h, N * 4, 1 | 2)   # Portable | Mapped
        d = cp.cuda.runtime.hostGetDevicePointer(h, 0)
    else:
        a = cp.zeros(N, dtype=cp.uint32); d = a.data.ptr
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        SPIN((64,), (256,), (cp.uint64(d), cp.int32(N)))
    print("go", flush=True)
    time.sleep(100)

def survivor():
    b = cp.zeros(1 << 20, dtype=cp.float32)
    cp.cuda.runtime.deviceSynchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.time(); n = 0; err = None
    try:
        while time.time() - t0 < 2.0:
            b += 1; n += 1; cp.cuda.runtime.deviceSynchronize()
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    print(json.dumps({"survivor_ops": n, "error": err}), flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "v": victim(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "s": survivor()
    else:
        for kind in ("device",):
            for trial in range(3):
                s = subprocess.Popen([sys.executable, __file__, "s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                s.stdout.readline()
                v = subprocess.Popen([sys.executable, __file__, "v", kind], stdout=subprocess.PIPE, text=True)
                v.stdout.readline(); time.sleep(0.5)
                if os.environ.get("TERMINATE"):
                    srv = subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", capture_output=True, text=True).stdout.split()
                    for sp in srv:
                        r = subprocess.run(["nvidia-cuda-mps-control"], input=f"terminate_client {sp} {v.pid}\n", capture_output=True, text=True, timeout=20)
                        print("terminate_client", sp, v.pid, repr(r.stdout.strip()), repr(r.stderr.strip()), flush=True)
                v.send_signal(signal.SIGKILL); v.wait()
                s.stdin.write("go\n"); s.stdin.flush()
                print(kind, trial, s.stdout.read().strip(), flush=True); s.wait()
