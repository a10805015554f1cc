# Every dependency comes from Debian's packages (scripts/install-deps.sh installs them).
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(yaml-cpp CONFIG REQUIRED)
find_package(spdlog CONFIG REQUIRED)
find_package(cpprestsdk CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(Boost 1.74 REQUIRED)  # Beast, header-only
find_package(CLI11 CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(SYSTEMD REQUIRED IMPORTED_TARGET libsystemd)
# nghttp2: HTTP/2 for the router's gRPC server (common/grpc_h2_server.h).
pkg_check_modules(NGHTTP2 REQUIRED IMPORTED_TARGET libnghttp2)
# jemalloc: kiln-controller's allocator. Its loop builds and frees every node's assignment each
# pass (hundreds of thousands of small strings at 10,000 nodes), where glibc's malloc spent
# half of placement's time (bench/RESULTS.md, 2026-11-25).
pkg_check_modules(JEMALLOC REQUIRED IMPORTED_TARGET jemalloc)

# LibTorch is found here but linked by exactly one target: runtime/kiln_backend_torchscript.
find_package(Torch REQUIRED)

find_program(KILN_PROTOC protoc REQUIRED)
find_program(KILN_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
