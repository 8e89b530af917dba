#include "qkvshare/server/api.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

#include "qkvshare/share/descriptor.hpp"

namespace qkvshare::server {

using nlohmann::json;

void bad_request(std::string_view param, const std::string& message) {
  throw ApiError(400, "invalid_request_error", std::string(param), message);
}

std::string quote_input(std::string_view text) {
  std::string out = "'";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) out += fmt::format("\\u{:04x}", u);
    else out += c;
  }
  return out + "'";
}

std::string_view to_string(ReuseMode mode) noexcept {
  switch (mode) {
    case ReuseMode::none: return "none";
    case ReuseMode::continue_: return "continue";
    case ReuseMode::fork: return "fork";
    case ReuseMode::splice: return "splice";
  }
  return "none";
}

std::string error_body(int status, std::string_view type, std::string_view param, std::string_view message) {
  json e = {{"message", message}, {"type", type}, {"code", status}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::pair<int, std::string> error_response(const std::exception& ex) {
  if (const auto* a = dynamic_cast<const ApiError*>(&ex)) return {a->status(), error_body(a->status(), a->type(), a->param(), a->what())};
  if (const auto* e = dynamic_cast<const Error*>(&ex)) {
    switch (e->code()) {
      case ErrorCode::invalid_argument: return {400, error_body(400, "invalid_request_error", "", e->what())};
      case ErrorCode::context_full: return {400, error_body(400, "context_length_exceeded", "", e->what())};
      case ErrorCode::out_of_memory: return {503, error_body(503, "pool_exhausted", "", e->what())};
      case ErrorCode::bad_descriptor: return {404, error_body(404, "not_found_error", "qkvshare.context", e->what())};
      case ErrorCode::unsupported: return {501, error_body(501, "not_implemented", "", e->what())};
      default: return {500, error_body(500, "server_error", "", e->what())};
    }
  }
  return {500, error_body(500, "server_error", "", ex.what())};
}

namespace {

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_float: return "a number";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    default: return "an unknown value";
  }
}

std::string get_string(const json& v, std::string_view param, const Limits& limits) {
  if (!v.is_string()) bad_request(param, fmt::format("'{}' must be a string, got {}", param, type_name(v)));
  const auto& s = v.get_ref<const std::string&>();
  if (s.size() > limits.max_string_bytes)
    bad_request(param, fmt::format("'{}' is {} bytes, more than the limit of {}", param, s.size(), limits.max_string_bytes));
  return s;
}

double get_number(const json& v, std::string_view param, double lo, double hi) {
  if (!v.is_number()) bad_request(param, fmt::format("'{}' must be a number, got {}", param, type_name(v)));
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    bad_request(param, fmt::format("'{}' must be between {} and {}, got {}", param, lo, hi, x));
  return x;
}

// JSON reads an integer literal too large for 64 bits as a double.
bool is_huge_integer(const json& v) {
  if (!v.is_number_float()) return false;
  const double x = v.get<double>();
  return std::isfinite(x) && std::trunc(x) == x && std::fabs(x) >= 0x1p63;
}

std::int64_t get_int(const json& v, std::string_view param, std::int64_t lo, std::int64_t hi) {
  if (is_huge_integer(v))
    bad_request(param, fmt::format("'{}' is out of range: it must be between {} and {}", param, lo, hi));
  if (!v.is_number_integer())
    bad_request(param, fmt::format("'{}' must be an integer, got {}", param, type_name(v)));
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
    bad_request(param, fmt::format("'{}' must be between {} and {}, got {}", param, lo, hi, v.get<std::uint64_t>()));
  const std::int64_t x = v.get<std::int64_t>();
  if (x < lo || x > hi) bad_request(param, fmt::format("'{}' must be between {} and {}, got {}", param, lo, hi, x));
  return x;
}

bool get_bool(const json& v, std::string_view param) {
  if (!v.is_boolean()) bad_request(param, fmt::format("'{}' must be a boolean, got {}", param, type_name(v)));
  return v.get<bool>();
}

// Message content: a string, or an array of {"type": "text", "text": ...} parts.
std::string message_content(const json& v, const std::string& param, const Limits& limits) {
  if (v.is_null()) return {};
  if (v.is_string()) return get_string(v, param, limits);
  if (!v.is_array()) bad_request(param, fmt::format("'{}' must be a string or an array of text parts, got {}", param, type_name(v)));
  std::string text;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string p = fmt::format("{}[{}]", param, i);
    const json& part = v[i];
    if (!part.is_object()) bad_request(p, fmt::format("'{}' must be an object, got {}", p, type_name(part)));
    const auto type = part.find("type");
    if (type == part.end() || !type->is_string() || *type != "text")
      bad_request(p + ".type", fmt::format("'{}.type' must be \"text\" (only text content is supported)", p));
    const auto t = part.find("text");
    if (t == part.end()) bad_request(p + ".text", fmt::format("'{}.text' is missing", p));
    text += get_string(*t, p + ".text", limits);
    if (text.size() > limits.max_string_bytes)
      bad_request(param, fmt::format("'{}' is longer than the limit of {} bytes", param, limits.max_string_bytes));
  }
  return text;
}

std::vector<ChatMessage> decode_messages(const json& v, const Limits& limits) {
  if (!v.is_array()) bad_request("messages", fmt::format("'messages' must be an array, got {}", type_name(v)));
  if (v.empty()) bad_request("messages", "'messages' must hold at least one message");
  if (v.size() > static_cast<std::size_t>(limits.max_messages))
    bad_request("messages", fmt::format("'messages' holds {} messages, more than the limit of {}", v.size(), limits.max_messages));
  std::vector<ChatMessage> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string p = fmt::format("messages[{}]", i);
    const json& m = v[i];
    if (!m.is_object()) bad_request(p, fmt::format("'{}' must be an object, got {}", p, type_name(m)));
    const auto role = m.find("role");
    if (role == m.end()) bad_request(p + ".role", fmt::format("'{}.role' is missing", p));
    std::string r = get_string(*role, p + ".role", limits);
    if (r == "developer") r = "system";  // OpenAI's newer name for the system role
    if (r != "system" && r != "user" && r != "assistant")
      bad_request(p + ".role", fmt::format("'{}.role' must be system, user, assistant or developer, got {}", p, quote_input(r)));
    if (m.contains("tool_calls") && !m["tool_calls"].is_null() && !(m["tool_calls"].is_array() && m["tool_calls"].empty()))
      bad_request(p + ".tool_calls", fmt::format("'{}.tool_calls': tool calls are not supported", p));
    const auto content = m.find("content");
    if (content == m.end()) bad_request(p + ".content", fmt::format("'{}.content' is missing", p));
    // OpenAI lets only an assistant turn (one that made tool calls) have no content.
    if (content->is_null() && r != "assistant")
      bad_request(p + ".content", fmt::format("'{}.content' must not be null in a {} message", p, r));
    out.push_back({std::move(r), message_content(*content, p + ".content", limits)});
  }
  return out;
}

std::vector<std::string> decode_agent_list(const json& v, std::string_view param) {
  std::vector<std::string> out;
  const auto one = [&](const json& x, const std::string& p) {
    if (!x.is_string()) bad_request(p, fmt::format("'{}' must be an agent id string, got {}", p, type_name(x)));
    try {
      validate_agent_id(x.get<std::string>(), p);
    } catch (const Error& e) {
      bad_request(p, e.what());
    }
    out.push_back(x.get<std::string>());
  };
  if (v.is_array()) {
    if (v.size() > 16) bad_request(param, fmt::format("'{}' names {} agents, more than 16", param, v.size()));
    for (std::size_t i = 0; i < v.size(); ++i) one(v[i], fmt::format("{}[{}]", param, i));
  } else {
    one(v, std::string(param));
  }
  return out;
}

Extension decode_extension(const json& v, const Limits& limits) {
  if (!v.is_object()) bad_request("qkvshare", fmt::format("'qkvshare' must be an object, got {}", type_name(v)));
  Extension ext;
  bool mode_given = false;
  for (const auto& [key, value] : v.items()) {
    const std::string p = "qkvshare." + key;
    if (key == "context") {
      if (value.is_object()) {  // a response's qkvshare.context object sent back as is
        const auto h = value.find("handle");
        if (h == value.end()) bad_request(p + ".handle", fmt::format("'{}.handle' is missing", p));
        ext.context = get_string(*h, p + ".handle", limits);
      } else {
        ext.context = get_string(value, p, limits);
      }
      if (ext.context.empty()) bad_request(p, fmt::format("'{}' is empty", p));
    } else if (key == "mode") {
      const std::string m = get_string(value, p, limits);
      if (m == "continue") ext.mode = ReuseMode::continue_;
      else if (m == "fork") ext.mode = ReuseMode::fork;
      else if (m == "splice") ext.mode = ReuseMode::splice;
      else bad_request(p, fmt::format("'{}' must be continue, fork or splice, got {}", p, quote_input(m)));
      mode_given = true;
    } else if (key == "kv") {
      ext.kv = get_string(value, p, limits);
    } else if (key == "grant_to") {
      ext.grant_to = decode_agent_list(value, p);
    } else if (key == "reuse") {
      ext.auto_reuse = get_bool(value, p);
    } else if (key == "recompute") {
      ext.recompute = get_number(value, p, 0.0, 1.0);
    } else {
      bad_request(p, fmt::format(
                         "{} is not a field of the qkvshare extension (context, mode, kv, grant_to, reuse, recompute)", quote_input(p)));
    }
  }
  if (ext.recompute && ext.mode != ReuseMode::splice)
    bad_request("qkvshare.recompute", "'qkvshare.recompute' applies to mode splice only");
  if (mode_given && ext.context.empty())
    bad_request("qkvshare.mode", "'qkvshare.mode' needs 'qkvshare.context' (the context to continue, fork or splice)");
  if (!ext.context.empty() && ext.mode == ReuseMode::none) ext.mode = ReuseMode::continue_;
  return ext;
}

// Options that change the output which this server does not implement: refuse
// rather than silently ignore them (a client relying on them would be misled).
void refuse_unsupported(const json& body) {
  const auto refuse_if = [&](const char* key, auto&& is_default) {
    const auto it = body.find(key);
    if (it != body.end() && !it->is_null() && !is_default(*it))
      throw ApiError(400, "invalid_request_error", key, fmt::format("'{}' is not supported by this server", key));
  };
  const auto zero = [](const json& v) { return v.is_number() && v.get<double>() == 0.0; };
  const auto is_false = [](const json& v) { return v.is_boolean() && !v.get<bool>(); };
  const auto empty = [](const json& v) { return (v.is_array() || v.is_object()) && v.empty(); };
  refuse_if("frequency_penalty", zero);
  refuse_if("presence_penalty", zero);
  refuse_if("logprobs", [&](const json& v) { return is_false(v); });
  refuse_if("top_logprobs", zero);
  refuse_if("echo", is_false);
  refuse_if("suffix", [](const json& v) { return v.is_string() && v.get<std::string>().empty(); });
  refuse_if("best_of", [](const json& v) { return v.is_number_integer() && v.get<std::int64_t>() == 1; });
  refuse_if("logit_bias", empty);
  refuse_if("tools", empty);
  refuse_if("functions", empty);
  refuse_if("tool_choice", [](const json& v) { return v.is_string() && v.get<std::string>() == "none"; });
  refuse_if("response_format", [](const json& v) {
    return v.is_object() && v.contains("type") && v["type"].is_string() && v["type"] == "text";
  });
}

}  // namespace

CompletionRequest decode_request(Endpoint endpoint, std::string_view body, const Limits& limits) {
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    bad_request("", fmt::format("the request body is not valid JSON: {}", e.what()));
  }
  if (!j.is_object()) bad_request("", fmt::format("the request body must be a JSON object, got {}", type_name(j)));
  refuse_unsupported(j);
  CompletionRequest r;
  r.endpoint = endpoint;
  const auto field = [&](const char* key) -> const json* {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  if (const json* v = field("model")) r.model = get_string(*v, "model", limits);
  if (endpoint == Endpoint::chat) {
    const json* m = field("messages");
    if (m == nullptr) bad_request("messages", "'messages' is required");
    r.messages = decode_messages(*m, limits);
  } else {
    const json* p = field("prompt");
    if (p == nullptr) bad_request("prompt", "'prompt' is required");
    if (p->is_string()) {
      r.prompt = get_string(*p, "prompt", limits);
    } else if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) {
      r.prompt = get_string((*p)[0], "prompt[0]", limits);
    } else if (p->is_array() && !p->empty() && (*p)[0].is_number_integer()) {
      if (p->size() > limits.max_string_bytes) bad_request("prompt", "'prompt' holds too many token ids");
      for (std::size_t i = 0; i < p->size(); ++i)
        r.prompt_ids.push_back(static_cast<TokenId>(get_int((*p)[i], fmt::format("prompt[{}]", i), 0, std::numeric_limits<TokenId>::max())));
    } else {
      bad_request("prompt", fmt::format("'prompt' must be a string, one string in an array, or token ids, got {}", type_name(*p)));
    }
    if (r.prompt.empty() && r.prompt_ids.empty()) bad_request("prompt", "'prompt' is empty");
  }
  const json* mt = field("max_completion_tokens");
  if (mt == nullptr) mt = field("max_tokens");
  if (mt != nullptr)
    r.max_tokens = static_cast<int>(get_int(*mt, field("max_completion_tokens") ? "max_completion_tokens" : "max_tokens", 1, limits.max_tokens));
  else
    r.max_tokens = std::min(r.max_tokens, limits.max_tokens);
  if (const json* v = field("temperature")) r.temperature = static_cast<float>(get_number(*v, "temperature", 0.0, 2.0));
  if (const json* v = field("top_p")) r.top_p = static_cast<float>(get_number(*v, "top_p", 0.0, 1.0));
  if (r.top_p == 0.0f) bad_request("top_p", "'top_p' must be greater than 0");
  if (const json* v = field("seed")) r.seed = static_cast<std::uint64_t>(get_int(*v, "seed", std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()));
  if (const json* v = field("n")) r.n = static_cast<int>(get_int(*v, "n", 1, limits.max_n));
  if (const json* v = field("stream")) r.stream = get_bool(*v, "stream");
  if (const json* v = field("ignore_eos")) r.ignore_eos = get_bool(*v, "ignore_eos");
  if (const json* v = field("stop")) {
    if (v->is_string()) {
      r.stop.push_back(get_string(*v, "stop", limits));
    } else if (v->is_array()) {
      if (v->size() > static_cast<std::size_t>(limits.max_stops))
        bad_request("stop", fmt::format("'stop' holds {} strings, more than {}", v->size(), limits.max_stops));
      for (std::size_t i = 0; i < v->size(); ++i) r.stop.push_back(get_string((*v)[i], fmt::format("stop[{}]", i), limits));
    } else {
      bad_request("stop", fmt::format("'stop' must be a string or an array of strings, got {}", type_name(*v)));
    }
    for (std::size_t i = 0; i < r.stop.size(); ++i)
      if (r.stop[i].empty()) bad_request("stop", "'stop' strings must not be empty");
  }
  if (const json* v = field("stream_options")) {
    if (!v->is_object()) bad_request("stream_options", fmt::format("'stream_options' must be an object, got {}", type_name(*v)));
    if (!r.stream) bad_request("stream_options", "'stream_options' is only allowed with 'stream': true");
    if (const auto u = v->find("include_usage"); u != v->end()) r.include_usage = get_bool(*u, "stream_options.include_usage");
  }
  if (const json* v = field("qkvshare")) r.ext = decode_extension(*v, limits);
  return r;
}

std::vector<std::string> decode_fork_request(std::string_view body) {
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) return {};
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    bad_request("", fmt::format("the request body is not valid JSON: {}", e.what()));
  }
  if (!j.is_object()) bad_request("", fmt::format("the request body must be a JSON object, got {}", type_name(j)));
  std::vector<std::string> grants;
  for (const auto& [key, value] : j.items()) {
    if (key == "grant_to") grants = decode_agent_list(value, "grant_to");
    else bad_request(key, fmt::format("{} is not a field of a fork request (grant_to)", quote_input(key)));
  }
  return grants;
}

namespace {
constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
constexpr std::string_view kHandlePrefix = "qkv1.";
}  // namespace

std::string encode_handle(const std::vector<std::uint8_t>& bytes) {
  std::string out(kHandlePrefix);
  std::uint32_t acc = 0;
  int bits = 0;
  for (std::uint8_t b : bytes) {
    acc = (acc << 8) | b;
    bits += 8;
    while (bits >= 6) {
      bits -= 6;
      out += kB64[(acc >> bits) & 63];
    }
  }
  if (bits > 0) out += kB64[(acc << (6 - bits)) & 63];
  return out;
}

std::vector<std::uint8_t> decode_handle(std::string_view text, std::string_view param) {
  if (text.substr(0, kHandlePrefix.size()) != kHandlePrefix)
    bad_request(param, fmt::format("'{}' is neither a context handle (qkv1.…) nor a context id (ctx-…)", param));
  text.remove_prefix(kHandlePrefix.size());
  std::vector<std::uint8_t> out;
  std::uint32_t acc = 0;
  int bits = 0;
  for (char c : text) {
    const char* p = c == '\0' ? nullptr : std::char_traits<char>::find(kB64, 64, c);
    if (p == nullptr) bad_request(param, fmt::format("'{}': the handle has a character outside base64url", param));
    acc = (acc << 6) | static_cast<std::uint32_t>(p - kB64);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<std::uint8_t>((acc >> bits) & 0xff));
    }
  }
  if (out.size() != kDescriptorBytes)
    bad_request(param, fmt::format("'{}': the handle holds {} bytes, a descriptor has {}", param, out.size(), kDescriptorBytes));
  return out;
}

}  // namespace qkvshare::server
