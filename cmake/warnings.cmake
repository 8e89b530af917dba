# Warnings are errors on project code only (third-party headers are SYSTEM includes).
function(qkvshare_warnings target)
  target_compile_options(${target} PRIVATE
    -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align
    -Woverloaded-virtual -Wimplicit-fallthrough -Werror
    # GCC 12 reports false stringop-overflow in inlined std::vector copies at -O3 (GCC bug 107138).
    # and a false -Wrestrict on std::string appends (GCC bug 105329); with -fPIC (the Python
    # extension's build) the same inlined vector insert of one byte is reported as stringop-overread.
    "$<$<CXX_COMPILER_ID:GNU>:-Wno-stringop-overflow;-Wno-restrict;-Wno-stringop-overread>")
endfunction()
