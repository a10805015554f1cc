# The one kiln image: kiln-controller, kilnctl, kiln-agent and kiln-runtime on Debian 12,
# built with the README's own commands (scripts/install-deps.sh, scripts/build.sh).
#   docker build -t kiln:0.1.0 .
FROM debian:12 AS build
WORKDIR /src
COPY . .
RUN apt-get update \
 && scripts/install-deps.sh \
 && scripts/build.sh \
 && cmake --install build --prefix /usr --strip \
 && rm -rf /var/lib/apt/lists/*

FROM debian:12
# Runtime libraries only: the -dev packages' shared objects the binaries link against.
RUN apt-get update && apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libyaml-cpp0.7 libspdlog1.10 libfmt9 libcpprest2.10 \
      libsystemd0 libnuma1 libsqlite3-0 libssl3 libjemalloc2 libtorch1.13 libopenblas0-openmp \
      libnghttp2-14 \
      ca-certificates \
      $(apt-cache depends libabsl-dev | awk '/Depends: libabsl2/{print $2}') \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/bin/kiln-controller /usr/bin/kilnctl /usr/bin/kiln-agent /usr/bin/kiln-runtime /usr/bin/
COPY --from=build /usr/share/kiln /usr/share/kiln
# kiln-runtime's libtorch_cpu without the libraries it never calls (cmake/Dependencies.cmake).
COPY --from=build /usr/lib/kiln /usr/lib/kiln
# The controller runs as 65532 (manifests/controller.yaml); the agent as root for NVML power
# control, with every capability dropped unless the chart's GPU power policy adds one.
USER 65532:65532
ENTRYPOINT ["/usr/bin/kiln-controller"]
