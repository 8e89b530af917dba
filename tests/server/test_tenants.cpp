// API key file parsing and lookups.
#include <gtest/gtest.h>

#include "qkvshare/core/error.hpp"
#include "qkvshare/server/tenants.hpp"

using namespace qkvshare;
using namespace qkvshare::server;

TEST(Tenants, NoKeysMeansOneDefaultTenant) {
  Tenants t;
  EXPECT_FALSE(t.enabled());
  EXPECT_EQ(t.authenticate(""), "default");
  EXPECT_EQ(t.authenticate("Bearer anything"), "default");
}

TEST(Tenants, KeysMapToTenants) {
  const Tenants t = Tenants::parse("# team keys\n\nkey-aaaaaaaaaaaaaaaa alice\r\n  key-bbbbbbbbbbbbbbbb\tbob  \n", "keys");
  EXPECT_EQ(t.size(), 2u);
  EXPECT_EQ(t.authenticate("Bearer key-aaaaaaaaaaaaaaaa"), "alice");
  EXPECT_EQ(t.authenticate("Bearer key-bbbbbbbbbbbbbbbb"), "bob");
  EXPECT_EQ(t.authenticate("Bearer key-bbbbbbbbbbbbbbb"), std::nullopt);  // a prefix is not the key
  EXPECT_EQ(t.authenticate("key-aaaaaaaaaaaaaaaa"), std::nullopt);       // not a Bearer header
  EXPECT_EQ(t.authenticate(""), std::nullopt);
}

TEST(Tenants, BadFilesNameTheLine) {
  const auto message = [](const char* text) {
    try {
      Tenants::parse(text, "keys.txt");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("").find("no API keys"), std::string::npos);
  EXPECT_NE(message("onlyonewordhere-xxxxxx\n").find("keys.txt:1"), std::string::npos);
  EXPECT_NE(message("# c\nshort alice\n").find("keys.txt:2"), std::string::npos);
  EXPECT_NE(message("key-aaaaaaaaaaaaaaaa bad/tenant\n").find("keys.txt:1"), std::string::npos);
  EXPECT_NE(message("key-aaaaaaaaaaaaaaaa a b\n").find("more words"), std::string::npos);
  EXPECT_NE(message("key-aaaaaaaaaaaaaaaa a\nkey-aaaaaaaaaaaaaaaa b\n").find("twice"), std::string::npos);
  EXPECT_THROW(Tenants::load("/nonexistent/keys"), Error);
}
