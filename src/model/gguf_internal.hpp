#pragma once
// Helpers shared by the GGUF reader, its getters and the writer; not public API.
#include <string>
#include <string_view>

namespace qkvshare::gguf_detail {

// Quotes a key or tensor name read from a file for an error message: control
// and non-ASCII bytes are escaped and long names are cut, so a forged name
// cannot garble the terminal or flood the log.
std::string printable(std::string_view s);

}  // namespace qkvshare::gguf_detail
