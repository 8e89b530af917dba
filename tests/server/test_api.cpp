// The request decoder: every field checked, bad ones named.
#include <gtest/gtest.h>

#include "qkvshare/server/api.hpp"

using namespace qkvshare;
using namespace qkvshare::server;

namespace {

// The ApiError a body raises, or a failure when it decodes.
ApiError error_of(Endpoint e, const std::string& body) {
  try {
    decode_request(e, body);
  } catch (const ApiError& err) {
    return err;
  }
  ADD_FAILURE() << "decoded without error: " << body;
  return ApiError(0, "", "", "");
}

}  // namespace

TEST(ServerApi, DecodesAChatRequest) {
  const auto r = decode_request(Endpoint::chat, R"({"model":"m","messages":[{"role":"system","content":"be brief"},
    {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}],
    "max_tokens":7,"temperature":0.5,"top_p":0.9,"stop":["\n","END"],"seed":42,"n":2,"stream":true,
    "stream_options":{"include_usage":true},"frequency_penalty":0,"some_future_field":{"x":1},
    "qkvshare":{"context":"ctx-00000000000000ab","mode":"fork","kv":"int4","grant_to":["writer","critic"]}})");
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[1].content, "hi there");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.top_p, 0.9f);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_EQ(r.seed, 42u);
  EXPECT_EQ(r.n, 2);
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_FALSE(r.ignore_eos);
  EXPECT_EQ(r.ext.context, "ctx-00000000000000ab");
  EXPECT_EQ(r.ext.mode, ReuseMode::fork);
  EXPECT_EQ(r.ext.kv, "int4");
  EXPECT_EQ(r.ext.grant_to, (std::vector<std::string>{"writer", "critic"}));
}

TEST(ServerApi, DefaultsAndCompletionPrompts) {
  auto r = decode_request(Endpoint::completion, R"({"prompt":"abc"})");
  EXPECT_EQ(r.prompt, "abc");
  EXPECT_EQ(r.max_tokens, 256);
  EXPECT_FLOAT_EQ(r.temperature, 1.0f);
  EXPECT_EQ(r.ext.mode, ReuseMode::none);
  r = decode_request(Endpoint::completion, R"({"prompt":[1,2,3],"max_completion_tokens":3})");
  EXPECT_EQ(r.prompt_ids, (std::vector<TokenId>{1, 2, 3}));
  EXPECT_EQ(r.max_tokens, 3);
  r = decode_request(Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":{"context":"qkv1.x"}})");
  EXPECT_EQ(r.ext.mode, ReuseMode::continue_);  // a named context without a mode continues it
  r = decode_request(Endpoint::completion, R"({"prompt":"abc","ignore_eos":true})");
  EXPECT_TRUE(r.ignore_eos);
}

TEST(ServerApi, BadRequestsNameTheField) {
  struct Case {
    Endpoint e;
    const char* body;
    const char* param;
  };
  const Case cases[] = {
      {Endpoint::chat, R"({"messages": [}", ""},
      {Endpoint::chat, R"([1,2])", ""},
      {Endpoint::chat, R"({})", "messages"},
      {Endpoint::chat, R"({"messages":[]})", "messages"},
      {Endpoint::chat, R"({"messages":"hi"})", "messages"},
      {Endpoint::chat, R"({"messages":[{"role":"wizard","content":"x"}]})", "messages[0].role"},
      {Endpoint::chat, R"({"messages":[{"role":"user"}]})", "messages[0].content"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", "messages[0].content[0].type"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":"5"})", "max_tokens"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})", "max_tokens"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":99999999999})", "max_tokens"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"temperature":3})", "temperature"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"top_p":0})", "top_p"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"n":0})", "n"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"stop":[1]})", "stop[0]"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]})", "stop"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"stream":"yes"})", "stream"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"ignore_eos":1})", "ignore_eos"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}})", "stream_options"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", "tools"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})", "logprobs"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"presence_penalty":0.5})", "presence_penalty"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":[]})", "qkvshare"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":{"contxt":"a"}})", "qkvshare.contxt"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":{"mode":"fork"}})", "qkvshare.mode"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":{"context":"a","mode":"clone"}})", "qkvshare.mode"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":{"grant_to":["bad id!"]}})", "qkvshare.grant_to[0]"},
      {Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":{"reuse":1}})", "qkvshare.reuse"},
      {Endpoint::completion, R"({"prompt":5})", "prompt"},
      {Endpoint::completion, R"({"prompt":""})", "prompt"},
      {Endpoint::completion, R"({"prompt":[1,-2]})", "prompt[1]"},
  };
  for (const Case& c : cases) {
    const ApiError e = error_of(c.e, c.body);
    EXPECT_EQ(e.status(), 400) << c.body;
    EXPECT_EQ(e.param(), c.param) << c.body << " -> " << e.what();
    EXPECT_FALSE(std::string(e.what()).empty());
    if (*c.param) {
      EXPECT_NE(std::string(e.what()).find(c.param), std::string::npos) << e.what();
    }
  }
}

TEST(ServerApi, HugeIntegersAreOutOfRangeNotTheWrongType) {
  for (const char* body : {R"({"messages":[{"role":"user","content":"x"}],"max_tokens":18446744073709551616})",
                           R"({"messages":[{"role":"user","content":"x"}],"seed":1000000000000000000000000000000})",
                           R"({"messages":[{"role":"user","content":"x"}],"seed":-1e30})"}) {
    const ApiError e = error_of(Endpoint::chat, body);
    EXPECT_EQ(e.status(), 400);
    EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
  }
  // A fraction is still the wrong type.
  EXPECT_NE(std::string(error_of(Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"seed":1.5})").what())
                .find("must be an integer"),
            std::string::npos);
}

TEST(ServerApi, NullContentIsRefusedButForAnAssistant) {
  const ApiError e = error_of(Endpoint::chat, R"({"messages":[{"role":"system","content":"x"},{"role":"user","content":null}]})");
  EXPECT_EQ(e.status(), 400);
  EXPECT_EQ(e.param(), "messages[1].content");
  EXPECT_NE(std::string(e.what()).find("'messages[1].content' must not be null"), std::string::npos) << e.what();
  const auto r = decode_request(Endpoint::chat,
                                R"({"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null}]})");
  EXPECT_EQ(r.messages[1].content, "");
}

TEST(ServerApi, QuotedUserStringsKeepTheirControlCharacters) {
  EXPECT_EQ(quote_input(std::string_view("ctx-\0\x01\x7f\n", 8)), "'ctx-\\u0000\\u0001\\u007f\\u000a'");
  EXPECT_EQ(quote_input("caf\xc3\xa9"), "'caf\xc3\xa9'");  // UTF-8 is left as it is
  const ApiError e = error_of(Endpoint::chat, std::string(R"({"messages":[{"role":"wiz\u0000ard","content":"x"}]})"));
  EXPECT_EQ(e.param(), "messages[0].role");
  EXPECT_NE(std::string(e.what()).find("got 'wiz\\u0000ard'"), std::string::npos) << e.what();
  const ApiError m = error_of(Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"qkvshare":{"context":"a","mode":"fo\u0000rk"}})");
  EXPECT_NE(std::string(m.what()).find("got 'fo\\u0000rk'"), std::string::npos) << m.what();
}

TEST(ServerApi, LimitsAreEnforced) {
  Limits l;
  l.max_tokens = 10;
  l.max_string_bytes = 8;
  EXPECT_THROW(decode_request(Endpoint::completion, R"({"prompt":"123456789"})", l), ApiError);
  EXPECT_THROW(decode_request(Endpoint::completion, R"({"prompt":"x","max_tokens":11})", l), ApiError);
  EXPECT_EQ(decode_request(Endpoint::completion, R"({"prompt":"x"})", l).max_tokens, 10);
}

TEST(ServerApi, HandlesRoundTripAndRejectGarbage) {
  std::vector<std::uint8_t> bytes(256);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(i * 7 + 3);
  const std::string h = encode_handle(bytes);
  EXPECT_EQ(h.rfind("qkv1.", 0), 0u);
  EXPECT_EQ(decode_handle(h, "p"), bytes);
  EXPECT_THROW(decode_handle("qkv2." + h.substr(5), "p"), ApiError);
  EXPECT_THROW(decode_handle(h.substr(0, h.size() - 4), "p"), ApiError);
  EXPECT_THROW(decode_handle(h + "AAAA", "p"), ApiError);
  std::string bad = h;
  bad[10] = '*';
  EXPECT_THROW(decode_handle(bad, "p"), ApiError);
  bad[10] = '\0';
  EXPECT_THROW(decode_handle(bad, "p"), ApiError);
}

TEST(ServerApi, ErrorShapeAndStatusOfOtherErrors) {
  const auto [s1, b1] = error_response(Error(ErrorCode::out_of_memory, "pool full"));
  EXPECT_EQ(s1, 503);
  EXPECT_NE(b1.find("\"pool full\""), std::string::npos);
  EXPECT_EQ(error_response(Error(ErrorCode::context_full, "x")).first, 400);
  EXPECT_EQ(error_response(Error(ErrorCode::bad_descriptor, "x")).first, 404);
  EXPECT_EQ(error_response(std::runtime_error("x")).first, 500);
  const auto [s2, b2] = error_response(ApiError(429, "rate_limit_error", "", "queue full"));
  EXPECT_EQ(s2, 429);
  EXPECT_NE(b2.find("\"error\""), std::string::npos);
  EXPECT_NE(b2.find("\"type\":\"rate_limit_error\""), std::string::npos);
}

TEST(ServerApi, ForkRequests) {
  EXPECT_TRUE(decode_fork_request("").empty());
  EXPECT_EQ(decode_fork_request(R"({"grant_to":"b"})"), std::vector<std::string>{"b"});
  EXPECT_THROW(decode_fork_request(R"({"grant":"b"})"), ApiError);
  EXPECT_THROW(decode_fork_request("{"), ApiError);
}
