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

# Debian's libtorch_cpu.so names ~25 libraries it takes no symbol from (OpenCV, FFmpeg, LevelDB,
# ZeroMQ...), which bring ~240 more: loading and initialising them is half of kiln-runtime's
# start on a small VM. kiln links a copy without those entries (scripts/trim-needed.sh checks
# that nothing it calls is lost), found through the runtime's RUNPATH and installed beside it
# in lib/kiln. Where LibTorch names nothing it does not use, or patchelf is missing, the
# original is linked as before.
option(KILN_TRIM_LIBTORCH "Link a copy of libtorch_cpu without the libraries it never calls" ON)
set(KILN_TRIMMED_LIBTORCH "")
if(KILN_TRIM_LIBTORCH AND TARGET torch_cpu)
  get_target_property(_kiln_torch_cpu torch_cpu LOCATION)
  get_filename_component(_kiln_torch_cpu "${_kiln_torch_cpu}" REALPATH)
  get_target_property(_kiln_torch_soname torch_cpu IMPORTED_SONAME)
  if(NOT _kiln_torch_soname)
    get_target_property(_kiln_torch_configs torch_cpu IMPORTED_CONFIGURATIONS)
    list(GET _kiln_torch_configs 0 _kiln_torch_config)
    get_target_property(_kiln_torch_soname torch_cpu IMPORTED_SONAME_${_kiln_torch_config})
  endif()
  set(_kiln_trimmed ${CMAKE_BINARY_DIR}/lib/${_kiln_torch_soname})
  file(SIZE "${_kiln_torch_cpu}" _kiln_torch_size)
  file(TIMESTAMP "${_kiln_torch_cpu}" _kiln_torch_time "%s" UTC)
  set(_kiln_trim_key "${_kiln_torch_cpu} ${_kiln_torch_size} ${_kiln_torch_time}")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_kiln_torch_cpu}")
  if(EXISTS ${_kiln_trimmed} AND "${KILN_TRIMMED_LIBTORCH_KEY}" STREQUAL "${_kiln_trim_key}")
    set(KILN_TRIMMED_LIBTORCH ${_kiln_trimmed})
  elseif(_kiln_torch_soname)
    execute_process(
      COMMAND sh ${CMAKE_SOURCE_DIR}/scripts/trim-needed.sh ${_kiln_torch_cpu} ${_kiln_trimmed}
      RESULT_VARIABLE _kiln_trim_rc OUTPUT_VARIABLE _kiln_trim_out ERROR_VARIABLE _kiln_trim_err
      OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_kiln_trim_rc EQUAL 0)
      string(REPLACE "\n" " " _kiln_trim_out "${_kiln_trim_out}")
      message(STATUS "kiln: linking ${_kiln_trimmed} (without ${_kiln_trim_out})")
      set(KILN_TRIMMED_LIBTORCH ${_kiln_trimmed})
      set(KILN_TRIMMED_LIBTORCH_KEY "${_kiln_trim_key}" CACHE INTERNAL "")
    elseif(_kiln_trim_rc EQUAL 3)
      message(STATUS "kiln: ${_kiln_torch_cpu} names no library it does not use")
    else()
      message(STATUS "kiln: linking ${_kiln_torch_cpu} as it is: ${_kiln_trim_err}")
    endif()
  endif()
  if(KILN_TRIMMED_LIBTORCH)
    get_target_property(_kiln_torch_configs torch_cpu IMPORTED_CONFIGURATIONS)
    set_target_properties(torch_cpu PROPERTIES IMPORTED_LOCATION ${KILN_TRIMMED_LIBTORCH})
    foreach(_c IN LISTS _kiln_torch_configs)
      set_target_properties(torch_cpu PROPERTIES IMPORTED_LOCATION_${_c} ${KILN_TRIMMED_LIBTORCH})
    endforeach()
    # LibTorch's config links torch_cpu through a raw linker flag, so CMake adds no RUNPATH
    # for it: every target built here looks in build/lib first.
    get_filename_component(_kiln_trimmed_dir ${KILN_TRIMMED_LIBTORCH} DIRECTORY)
    list(APPEND CMAKE_BUILD_RPATH ${_kiln_trimmed_dir})
  endif()
endif()

find_program(KILN_PROTOC protoc REQUIRED)
find_program(KILN_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
