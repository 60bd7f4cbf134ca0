// C entry points of the CPU emulator (built by kernels_cupy/emu.py with -include cuda_emu.h).
#include "paged_attention.cu"

typedef long long ll;
extern "C" {
void emu_write_kv(unsigned gx, unsigned gy, unsigned gz, unsigned bx, ll smem, const void* key, ll ks, const void* value,
                  ll vs, void* kc, void* vc, const void* slots, int hkv) {
  emu_run(gx, gy, gz, bx, smem, [&] {
    write_kv((const raw16*)key, ks, (const raw16*)value, vs, (raw16*)kc, (raw16*)vc, (const ll*)slots, hkv);
  });
}
void emu_paged_decode(unsigned gx, unsigned gy, unsigned gz, unsigned bx, ll smem, void* out, ll os, void* tmp, void* ml,
                      void* es, const void* q, ll qs, const void* kc, const void* vc, const void* bt, int bts,
                      const void* sl, int hkv, float scale, int ps) {
  emu_run(gx, gy, gz, bx, smem, [&] {
    paged_decode((raw16*)out, os, (float*)tmp, (float*)ml, (float*)es, (const raw16*)q, qs, (const raw16*)kc,
                 (const raw16*)vc, (const int*)bt, bts, (const int*)sl, hkv, scale, ps);
  });
}
void emu_paged_decode_reduce(unsigned gx, unsigned gy, unsigned gz, unsigned bx, ll smem, void* out, ll os,
                             const void* tmp, const void* ml, const void* es, const void* sl, int parts, int ps) {
  emu_run(gx, gy, gz, bx, smem, [&] {
    paged_decode_reduce((raw16*)out, os, (const float*)tmp, (const float*)ml, (const float*)es, (const int*)sl, parts, ps);
  });
}
void emu_paged_prefill(unsigned gx, unsigned gy, unsigned gz, unsigned bx, ll smem, void* out, ll os, const void* q,
                       ll qs, const void* kc, const void* vc, const void* bt, int bts, const void* sl, const void* qsl,
                       const void* tiles, int hkv, float scale) {
  emu_run(gx, gy, gz, bx, smem, [&] {
    paged_prefill((raw16*)out, os, (const raw16*)q, qs, (const raw16*)kc, (const raw16*)vc, (const int*)bt, bts,
                  (const int*)sl, (const int*)qsl, (const int*)tiles, hkv, scale);
  });
}
}
