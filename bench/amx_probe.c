// Executes one AMX instruction (tilezero) after asking Linux for the AMX tile state.
// Exit 0: AMX runs here. SIGILL or exit 2: the CPU reports AMX but this machine cannot run it
// (bench/build_llamacpp.sh then builds llama.cpp without AMX).
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>
int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return 2;
  unsigned char cfg[64]; memset(cfg, 0, sizeof cfg);
  cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;  /* palette 1, tile 0: 16 rows x 64 bytes */
  _tile_loadconfig(cfg); _tile_zero(0); _tile_release();
  return 0;
}
