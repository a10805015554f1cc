# kiln_proto_library(NAME proto_root FILES a.proto b.proto)
# Generates C++ message and gRPC service code for FILES (paths relative to proto_root).
function(kiln_proto_library name root)
  cmake_parse_arguments(ARG "" "" "FILES" ${ARGN})
  set(out ${CMAKE_CURRENT_BINARY_DIR}/gen)
  set(srcs)
  foreach(f ${ARG_FILES})
    get_filename_component(dir ${f} DIRECTORY)
    get_filename_component(stem ${f} NAME_WE)
    set(gen ${out}/${dir}/${stem}.pb.cc ${out}/${dir}/${stem}.pb.h
            ${out}/${dir}/${stem}.grpc.pb.cc ${out}/${dir}/${stem}.grpc.pb.h)
    add_custom_command(
      OUTPUT ${gen}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${out}
      COMMAND ${KILN_PROTOC} -I ${root} --cpp_out=${out} --grpc_out=${out}
              --plugin=protoc-gen-grpc=${KILN_GRPC_CPP_PLUGIN} ${root}/${f}
      DEPENDS ${root}/${f}
      COMMENT "protoc ${f}")
    list(APPEND srcs ${gen})
  endforeach()
  add_library(${name} STATIC ${srcs})
  target_include_directories(${name} PUBLIC ${out})
  target_link_libraries(${name} PUBLIC gRPC::grpc++ protobuf::libprotobuf)
  target_compile_options(${name} PRIVATE -w)
endfunction()
