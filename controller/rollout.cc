#include "controller/rollout.h"

#include <algorithm>
#include <cstdio>

namespace kiln {

namespace {

uint64_t Since(uint64_t now, uint64_t then) {
  return now >= then ? now - then : now;  // a counter that went back: the replica restarted
}

std::string Percent(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", v * 100);
  return buf;
}

std::string Ratio(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  return buf;
}

}  // namespace

nlohmann::json RolloutState::ToJson() const {
  nlohmann::json j = {{"phase", phase},
                      {"stableVersion", stable_version},
                      {"canaryVersion", canary_version},
                      {"canaryWeight", weight},
                      {"step", step},
                      {"message", message}};
  if (!failed_version.empty()) j["failedVersion"] = failed_version;
  if (paused) j["paused"] = true;
  if (promoting) j["promoting"] = true;
  if (!draining_version.empty()) {
    j["drainingVersion"] = draining_version;
    j["drainUntilMicros"] = absl::ToUnixMicros(drain_until);
  }
  if (step_started != absl::InfinitePast()) j["stepStartedMicros"] = absl::ToUnixMicros(step_started);
  // The counters a step is judged from: also between steps, where the last step's weight
  // still takes traffic and is still judged (a restart there must not judge lifetime totals).
  if (!canary_version.empty()) {
    j["counters"] = {stable_requests0, stable_errors0, canary_requests0, canary_errors0};
  }
  return j;
}

RolloutState RolloutState::FromJson(const nlohmann::json& j) {
  RolloutState s;
  if (!j.is_object()) return s;
  s.phase = j.value("phase", "");
  s.stable_version = j.value("stableVersion", "");
  s.canary_version = j.value("canaryVersion", "");
  s.failed_version = j.value("failedVersion", "");
  s.weight = j.value("canaryWeight", int64_t{0});
  s.step = j.value("step", int64_t{0});
  s.message = j.value("message", "");
  s.draining_version = j.value("drainingVersion", "");
  s.paused = j.value("paused", false);
  s.promoting = j.value("promoting", false);
  if (j.contains("drainUntilMicros") && j["drainUntilMicros"].is_number_integer()) {
    s.drain_until = absl::FromUnixMicros(j["drainUntilMicros"].get<int64_t>());
  }
  if (j.contains("stepStartedMicros") && j["stepStartedMicros"].is_number_integer()) {
    s.step_started = absl::FromUnixMicros(j["stepStartedMicros"].get<int64_t>());
  }
  if (j.contains("counters")) {
    const auto& c = j["counters"];
    if (c.is_array() && c.size() == 4 &&
        std::all_of(c.begin(), c.end(), [](const auto& v) { return v.is_number_unsigned(); })) {
      s.stable_requests0 = c[0].get<uint64_t>();
      s.stable_errors0 = c[1].get<uint64_t>();
      s.canary_requests0 = c[2].get<uint64_t>();
      s.canary_errors0 = c[3].get<uint64_t>();
    }
  }
  return s;
}

absl::StatusOr<RolloutAction> ParseRolloutAction(const std::string& text) {
  if (text == "pause") return RolloutAction::kPause;
  if (text == "resume") return RolloutAction::kResume;
  if (text == "abort") return RolloutAction::kAbort;
  if (text == "promote") return RolloutAction::kPromote;
  return absl::InvalidArgumentError("action: must be pause, resume, abort or promote, got '" +
                                    text + "'");
}

int64_t CanaryReplicasFor(int64_t replicas, int64_t weight) {
  return std::max<int64_t>(1, (replicas * weight + 99) / 100);
}

RolloutPlan PlanRollout(const ModelDeploymentSpec& spec, const RolloutState& state,
                        const VersionStats& stable, const VersionStats& canary, absl::Time now,
                        RolloutAction action) {
  RolloutPlan p;
  p.state = state;
  RolloutState& s = p.state;
  // A promotion, once begun, completes: the old version has given up replicas for the new
  // one, so dropping the new one now (an abort, or a spec naming another version) would leave
  // too few serving. What the spec names next is rolled out after it, make before break too.
  const std::string& want = s.promoting && !s.canary_version.empty() ? s.canary_version
                                                                      : spec.model.version;
  const std::string waiting =
      want != spec.model.version ? "; version " + spec.model.version + " waits for it" : "";
  const int64_t replicas = spec.replicas;
  auto stable_only = [&]() {
    p.stable_version = s.stable_version;
    p.stable_replicas = replicas;
    p.canary_version.clear();
    p.canary_replicas = 0;
    p.canary_weight = 0;
    if (!s.draining_version.empty() && now < s.drain_until) {
      p.old_version = s.draining_version;
      p.old_replicas = replicas;
    } else if (!s.draining_version.empty()) {
      p.events.push_back("version " + s.draining_version + " drained");
      s.draining_version.clear();
      s.drain_until = absl::InfinitePast();
    }
  };
  if (s.stable_version.empty()) {  // the first version is stable at once
    s.stable_version = want;
    s.phase = "Stable";
    s.message = "serving version " + want;
    stable_only();
    return p;
  }
  if (want == s.stable_version) {
    if (!s.canary_version.empty()) {
      p.events.push_back("rollout of version " + s.canary_version + " aborted: the spec is back at " +
                         want);
    }
    std::string draining = s.draining_version;
    absl::Time until = s.drain_until;
    s = RolloutState{"Stable", want, "", "", 0, 0, absl::InfinitePast(), 0, 0, 0, 0,
                     "serving version " + want, draining, until};
    stable_only();
    return p;
  }
  if (want == s.failed_version) {  // rolled back: held until the spec names another version
    s.phase = "Degraded";
    stable_only();
    return p;
  }
  if (s.canary_version != want) {
    p.events.push_back(s.canary_version.empty()
                           ? "rollout " + s.stable_version + " -> " + want + " started (" +
                                 spec.rollout.strategy + ")"
                           : "canary " + s.canary_version + " superseded by " + want);
    s.canary_version = want;
    s.failed_version.clear();
    s.step = 0;
    s.weight = 0;
    s.step_started = absl::InfinitePast();
    s.phase = "Progressing";
    s.paused = false;
    s.promoting = false;
  }

  std::vector<RolloutStep> steps = spec.rollout.steps;
  const std::string& strategy = spec.rollout.strategy;
  if (strategy == "BlueGreen" || steps.empty()) steps = {RolloutStep{100, absl::ZeroDuration(), false}};
  if (strategy == "ABTest") {
    for (auto& st : steps) st.pause_until_resumed = true;  // held until promote or abort
  }
  s.step = std::clamp<int64_t>(s.step, 0, static_cast<int64_t>(steps.size()) - 1);
  auto finish_promotion = [&](const std::string& why) {
    p.events.push_back("canary " + want + " promoted: " + why);
    const bool keep_old =
        strategy == "BlueGreen" && spec.rollout.scale_down_delay > absl::ZeroDuration();
    s = RolloutState{"Stable", want, "", "", 0, 0, absl::InfinitePast(), 0, 0, 0, 0,
                     "promoted version " + want + " (was " + state.stable_version + ")",
                     keep_old ? state.stable_version : "",
                     keep_old ? now + spec.rollout.scale_down_delay : absl::InfinitePast()};
    stable_only();
  };
  // Make before break, replica by replica: the stable set gives up a replica only for a canary
  // replica that serves (at most maxUnavailable fewer in all), so a promotion needs room for
  // one more replica, not a second set; the split follows the serving counts.
  auto promote = [&](const std::string& why) {
    if (canary.ready >= replicas) {
      finish_promotion(s.promoting ? "all " + std::to_string(replicas) + " replica(s) serve"
                                   : why);
      return;
    }
    if (!s.promoting) {
      p.events.push_back("canary " + want + " promoting (" + why + "): version " +
                         s.stable_version + " gives way replica by replica as version " + want +
                         "'s serve");
    }
    s.promoting = true;
    s.paused = false;
    s.phase = "Progressing";
    const int64_t serving = std::max<int64_t>(0, canary.ready);
    // The old version keeps the count, less one for each new replica that serves.
    const int64_t stable_left =
        std::max<int64_t>(0, replicas - spec.rollout.unavailable() - serving);
    // The split follows what serves on each side (as it was while nothing does).
    const int64_t stable_serving = std::min<int64_t>(stable.ready, stable_left);
    if (serving + stable_serving > 0) {
      s.weight = (100 * serving + (serving + stable_serving) / 2) / (serving + stable_serving);
    }
    s.message = "promoting version " + want + ": " + std::to_string(serving) + "/" +
                std::to_string(replicas) + " replica(s) serving at " + std::to_string(s.weight) +
                "%; version " + s.stable_version + " keeps " + std::to_string(stable_left) +
                waiting;
    p.stable_version = s.stable_version;
    p.stable_replicas = stable_left;
    p.canary_version = want;
    // One more at a time (maxSurge): room for one replica is all a promotion needs, and
    // other deployments' WARM replicas are not evicted for the whole set at once.
    p.canary_replicas =
        std::min<int64_t>(replicas, serving + std::max<int64_t>(1, spec.rollout.surge()));
    p.canary_weight = s.weight;
  };
  auto roll_back = [&](const std::string& why) {
    p.events.push_back(why);
    s.failed_version = want;
    s.canary_version.clear();
    s.weight = 0;
    s.step = 0;
    s.step_started = absl::InfinitePast();
    s.paused = false;
    s.promoting = false;
    s.phase = "Degraded";
    s.message = why;
    stable_only();
  };
  if (s.promoting) {  // decided: it completes (see `want` above)
    if (action == RolloutAction::kAbort || action == RolloutAction::kPause ||
        action == RolloutAction::kResume) {
      p.action_refused =
          "version " + want + " is being promoted; apply the previous version once it is done";
      if (action == RolloutAction::kAbort) p.events.push_back("abort refused: " + p.action_refused);
    }
    promote("");
    return p;
  }
  switch (action) {
    case RolloutAction::kAbort:
      roll_back("rollout of version " + want + " aborted by hand; back to " + s.stable_version);
      return p;
    case RolloutAction::kPromote:
      promote("by hand");
      return p;
    case RolloutAction::kPause:
      if (!s.paused) p.events.push_back("paused by hand at step " + std::to_string(s.step + 1));
      s.paused = true;
      break;
    case RolloutAction::kResume:
      if (s.paused) p.events.push_back("resumed by hand");
      s.paused = false;
      break;
    case RolloutAction::kNone:
      break;
  }
  const RolloutStep& step = steps[s.step];
  const int64_t need = strategy == "BlueGreen" ? replicas : CanaryReplicasFor(replicas, step.weight);
  p.stable_version = s.stable_version;
  p.stable_replicas = replicas;
  p.canary_version = want;
  p.canary_replicas = need;
  // "canary 2 step 1/3": step `number` (from 1) of this rollout.
  auto step_name = [&](int64_t number) {
    return "canary " + want + " step " + std::to_string(number) + "/" +
           std::to_string(steps.size());
  };
  const std::string where = step_name(s.step + 1);

  // The step has not begun: its replicas are still coming up, or it is paused by hand before
  // it began (its replicas still come up; its weight waits for a resume). The weight of the
  // step before, if any, still takes traffic and is still judged below.
  std::string held;
  bool began = false;  // this call began the step (a resume here is not also its gate's)
  if (s.step_started == absl::InfinitePast() && (canary.ready < need || s.paused)) {
    held = where + (canary.ready < need
                        ? ": waiting for " + std::to_string(need) + " canary replica(s) (" +
                              std::to_string(canary.ready) + " ready)"
                        : ": " + std::to_string(canary.ready) + " canary replica(s) ready");
    if (s.paused) held += "; paused by hand";
    p.canary_weight = s.weight;
    if (s.weight == 0) {  // no traffic yet: nothing to judge
      s.message = held;
      return p;
    }
  } else if (s.step_started == absl::InfinitePast()) {
    began = true;
    s.weight = step.weight;
    s.step_started = now;
    s.stable_requests0 = stable.requests;
    s.stable_errors0 = stable.errors;
    s.canary_requests0 = canary.requests;
    s.canary_errors0 = canary.errors;
    s.recent.clear();
    p.events.push_back(where + ": weight " + std::to_string(s.weight) + "%");
  }
  p.canary_weight = s.weight;

  // Analysis over the requests since the step began.
  const Analysis& a = spec.rollout.analysis;
  const uint64_t creq = Since(canary.requests, s.canary_requests0);
  const uint64_t cerr = Since(canary.errors, s.canary_errors0);
  const bool enough = static_cast<int64_t>(creq) >= a.min_requests;
  const double error_rate = creq > 0 ? static_cast<double>(cerr) / static_cast<double>(creq) : 0;
  const double p99_ratio = stable.p99_micros > 0 ? canary.p99_micros / stable.p99_micros : 1.0;
  std::string numbers = std::to_string(creq) + " requests, error rate " + Percent(error_rate) +
                        " (max " + Percent(a.max_error_rate) + "), p99 ratio " + Ratio(p99_ratio) +
                        " (max " + Ratio(a.max_latency_p99_ratio) + ")";
  // The recent window: from the newest sample at least kAnalysisWindow old (else the oldest).
  // A counter that went back (a canary replica restarted or stopped serving) makes the window's
  // differences meaningless: it starts again from here.
  if (!s.recent.empty() &&
      (canary.requests < s.recent.back().requests || canary.errors < s.recent.back().errors)) {
    s.recent.clear();
  }
  s.recent.push_back({now, canary.requests, canary.errors});
  while (s.recent.size() > 1 && s.recent[1].at <= now - kAnalysisWindow) s.recent.pop_front();
  const uint64_t wreq = Since(canary.requests, s.recent.front().requests);
  const uint64_t werr = Since(canary.errors, s.recent.front().errors);
  const double window_rate = wreq > 0 ? static_cast<double>(werr) / static_cast<double>(wreq) : 0;
  const bool window_bad = static_cast<int64_t>(wreq) >= a.min_requests && wreq > 0 &&
                          window_rate > a.max_error_rate;
  if (window_bad && !(enough && error_rate > a.max_error_rate)) {
    numbers += "; over the last " + absl::FormatDuration(now - s.recent.front().at) + ": " +
               std::to_string(wreq) + " requests, error rate " + Percent(window_rate);
  }
  // An A/B test compares the versions for people to judge: its numbers are shown, and only a
  // promote or an abort ends it.
  if (strategy != "ABTest" &&
      ((enough && creq > 0 &&
        (error_rate > a.max_error_rate || p99_ratio > a.max_latency_p99_ratio)) ||
       window_bad)) {
    // (Held before a step began, what failed is the step before, whose weight it still had.)
    roll_back((held.empty() ? where : step_name(s.step)) + " failed analysis: " + numbers +
              "; rolled back to " + s.stable_version);
    return p;
  }
  if (!held.empty()) {
    s.message = held + "; at " + std::to_string(s.weight) + "%: " + numbers;
    return p;
  }
  s.message = where + " at " + std::to_string(s.weight) + "%: " + numbers;
  if (s.paused) {
    s.message += "; paused by hand";
    return p;
  }
  const bool resumed = action == RolloutAction::kResume && !began;
  if (step.pause_until_resumed && !resumed) {
    s.message += strategy == "ABTest" ? "; A/B test running" : "; paused until resumed";
    return p;
  }
  if (step.pause_until_resumed && resumed && s.step + 1 >= static_cast<int64_t>(steps.size())) {
    promote("resumed at the last step: " + numbers);
    return p;
  }
  if (step.pause_until_resumed && resumed) {
    p.events.push_back(where + " resumed: " + numbers);
    s.step++;
    s.step_started = absl::InfinitePast();
    p.canary_replicas = CanaryReplicasFor(replicas, steps[s.step].weight);
    return p;
  }
  if (now - s.step_started < step.pause) return p;
  if (!enough) {
    s.message += "; waiting for " + std::to_string(a.min_requests) + " requests";
    return p;
  }
  if (s.step + 1 < static_cast<int64_t>(steps.size())) {
    p.events.push_back(where + " passed: " + numbers);
    s.step++;
    s.step_started = absl::InfinitePast();  // the next step begins once its replicas serve
    p.canary_replicas = strategy == "BlueGreen"
                            ? replicas
                            : CanaryReplicasFor(replicas, steps[s.step].weight);
    return p;
  }
  promote(numbers);
  return p;
}

}  // namespace kiln
