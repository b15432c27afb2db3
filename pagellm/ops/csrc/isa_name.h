/* The instruction set a kernel library was built for, as its pagellm_isa() reports it (cpu_build.py's build flags
 * define PAGELLM_ISA_*). */
#ifndef PAGELLM_ISA_NAME_H
#define PAGELLM_ISA_NAME_H

#if defined(PAGELLM_ISA_AVX512)
#define ISA_NAME "avx512"
#elif defined(PAGELLM_ISA_AVX2)
#define ISA_NAME "avx2"
#else
#define ISA_NAME "generic"
#endif

#endif
