#pragma once

// OIP v2 requests for the generated test models (scripts/make_models.py).
#include <cstdint>
#include <string>

#include "inference/grpc_service.pb.h"

namespace kiln::testing {

// The `slow` model: x [1,1] FP32 and work [1,1] INT64 (the bigger, the longer it runs;
// 2000 is about a third of a second). `timeout_us` > 0 sets the request's timeout parameter.
inline inference::ModelInferRequest SlowRequest(int64_t work, int64_t timeout_us = 0) {
  inference::ModelInferRequest req;
  req.set_model_name("slow");
  auto* x = req.add_inputs();
  x->set_name("x");
  x->set_datatype("FP32");
  x->add_shape(1);
  x->add_shape(1);
  x->mutable_contents()->add_fp32_contents(3.0f);
  auto* w = req.add_inputs();
  w->set_name("work");
  w->set_datatype("INT64");
  w->add_shape(1);
  w->add_shape(1);
  w->mutable_contents()->add_int64_contents(work);
  if (timeout_us > 0) (*req.mutable_parameters())["timeout"].set_int64_param(timeout_us);
  return req;
}

// The `encoder` model: input_ids [first_token, 2, 3, 4] and attention_mask [1, 2, 3, 4].
inline inference::ModelInferRequest EncoderRequest(int64_t first_token = 1) {
  inference::ModelInferRequest req;
  req.set_model_name("encoder");
  for (const char* name : {"input_ids", "attention_mask"}) {
    auto* in = req.add_inputs();
    in->set_name(name);
    in->set_datatype("INT64");
    in->add_shape(1);
    in->add_shape(4);
    for (int k = 0; k < 4; ++k) {
      in->mutable_contents()->add_int64_contents(
          std::string(name) == "input_ids" && k == 0 ? first_token : 1 + k);
    }
  }
  return req;
}

}  // namespace kiln::testing
