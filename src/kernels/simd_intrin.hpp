#pragma once
// <immintrin.h> for the ISA units. GCC 12 reports its own _mm512_undefined_*
// placeholders as uninitialized once inlined (GCC bug 105593); the warning
// points into the header, so it is silenced for the header's lines only and
// stays on for ours.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
