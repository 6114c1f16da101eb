"""D2D copy rate on one GPU, alone and beside a GEMM loop: cudaMemcpy (copy_) vs an SM copy kernel (call71)."""
import torch, time, statistics
dev="cuda"
src=torch.empty(680<<20,dtype=torch.uint8,device=dev); dst=torch.empty_like(src)
a=torch.randn(8192,8192,device=dev,dtype=torch.bfloat16); c=torch.empty_like(a)
def med(fn,r=7):
    out=[]
    for _ in range(r+1):
        torch.cuda.synchronize(); s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); out.append(s.elapsed_time(e))
    return statistics.median(out[1:])
t=med(lambda: dst.copy_(src)); print(f"D2D memcpy 680MB alone {t:.3f} ms = {src.numel()/t/1e6:.0f} GB/s")
s32,d32=src.view(torch.int32),dst.view(torch.int32)
t2=med(lambda: torch.bitwise_or(s32,0,out=d32)); print(f"SM copy (bitwise_or) alone {t2:.3f} ms = {src.numel()/t2/1e6:.0f} GB/s")
one=med(lambda: torch.mm(a,a,out=c)); n=max(1,round(20/one))
def gem():
    for _ in range(n): torch.mm(a,a,out=c)
tg=med(gem)
side=torch.cuda.Stream(); main=torch.cuda.current_stream()
for name,fn,k in (("memcpy x6",lambda: dst.copy_(src),6),("smcopy x6",lambda: torch.bitwise_or(s32,0,out=d32),6)):
    def both():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(k): fn()
        gem(); main.wait_stream(side)
    tb=med(both)
    print(f"{name} beside {tg:.2f} ms GEMMs: {tb:.2f} ms (+{tb-tg:.2f} ms; alone {k*(t if 'mem' in name else t2):.2f} ms)")
