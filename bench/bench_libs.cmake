# The bench's small client libraries, shared by bench/ and examples/ (the demo client links
# them whether or not KILN_BUILD_BENCH is on). Included from both; defined once.
include_guard(GLOBAL)

# A tiny blocking keep-alive HTTP/1.1 client over POSIX sockets (loadgen, demo client).
add_library(kiln_bench_http STATIC ${CMAKE_CURRENT_LIST_DIR}/http_client.cc)
target_include_directories(kiln_bench_http PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(kiln_bench_http PUBLIC absl::status absl::statusor absl::strings)

# OIP v2 request builders and response parsers for the encoder model.
add_library(kiln_bench_oip STATIC ${CMAKE_CURRENT_LIST_DIR}/oip.cc)
target_include_directories(kiln_bench_oip PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(kiln_bench_oip
  PUBLIC kiln_proto absl::status absl::statusor absl::strings
  PRIVATE nlohmann_json::nlohmann_json)
