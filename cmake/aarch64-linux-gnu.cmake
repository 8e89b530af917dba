# Cross-compiling for ARM64 Linux with Debian's toolchain (g++-aarch64-linux-gnu)
# and multiarch arm64 -dev packages (dpkg --add-architecture arm64): headers in
# /usr/include, arm64 libraries and their CMake/pkg-config files under
# /usr/lib/aarch64-linux-gnu. Tests run under qemu-user (scripts/test_aarch64.sh).
#   cmake -S . -B build-aarch64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Only the arm64 pkg-config files (PCRE2, xxHash), never the host's.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
# gtest_discover_tests and ctest run the test binaries through this.
find_program(QKVSHARE_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR ${QKVSHARE_QEMU_AARCH64})
