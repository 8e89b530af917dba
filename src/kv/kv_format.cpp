#include "qkvshare/kv/kv_format.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kernels/kv_tiles.hpp"
#include "qkvshare/kv/kv_codebook.hpp"

namespace qkvshare {

namespace {

constexpr std::size_t kTileAlign = 32;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

// Bits -> type; 32 and 16 are the float types.
bool type_for_bits(int bits, KvType& out) {
  switch (bits) {
    case 32: out = KvType::f32; return true;
    case 16: out = KvType::f16; return true;
    case 8: out = KvType::q8; return true;
    case 4: out = KvType::q4; return true;
    case 3: out = KvType::q3; return true;
    case 2: out = KvType::q2; return true;
    default: return false;
  }
}

// The default codecs of a named format: keys per channel (outlier channels,
// docs/design.md), values per token in groups of 32 channels (KIVI).
KvCodec default_codec(KvType type, bool is_key) {
  if (type == KvType::f32 || type == KvType::f16) return {type, KvAxis::token, 0};
  if (is_key) return {type, KvAxis::channel, 0};
  return {type, KvAxis::token, static_cast<std::uint16_t>(type == KvType::q8 ? 0 : 32)};
}

// "pqN" (N bits per element: 8 / N channels per index) -> a pq codec.
bool parse_pq(std::string_view name, KvCodec& out) {
  if (name == "pq4" || name == "pq2" || name == "pq1") {
    out = {KvType::pq, KvAxis::token, static_cast<std::uint16_t>(8 / (name[2] - '0'))};
    return true;
  }
  return false;
}

int parse_int(std::string_view text, std::string_view what, std::string_view whole) {
  int v = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size() || v < 0)
    fail(ErrorCode::invalid_argument, "KV format '{}': {} '{}' is not a non-negative integer", whole, what, text);
  return v;
}

std::string_view type_name(KvType t) {
  switch (t) {
    case KvType::f32: return "32";
    case KvType::f16: return "16";
    case KvType::q8: return "8";
    case KvType::q4: return "4";
    case KvType::q3: return "3";
    case KvType::q2: return "2";
    case KvType::pq: return "pq";
  }
  return "?";
}

// The name of one side in kXvY: bits, or pqN.
std::string side_name(const KvCodec& c) {
  return c.pq() ? fmt::format("pq{}", c.bits()) : std::string(type_name(c.type));
}

// A format's name: the K and V codecs (default axes and groups).
void parse_name(std::string_view name, const std::string& whole, KvCodec& k, KvCodec& v) {
  KvType kt{}, vt{};
  bool k_pq = false, v_pq = false;
  if (parse_pq(name, k)) {
    v = k;
    return;
  }
  if (name == "f32" || name == "f16" || name == "int8" || name == "int4" || name == "int3" || name == "int2") {
    const int bits = name == "f32" ? 32 : name == "f16" ? 16 : parse_int(name.substr(3), "bits", whole);
    type_for_bits(bits, kt);
    vt = kt;
  } else if (name.size() >= 4 && name[0] == 'k' && name.find('v') != std::string_view::npos) {
    const std::size_t vpos = name.find('v');
    const std::string_view ks = name.substr(1, vpos - 1), vs = name.substr(vpos + 1);
    k_pq = parse_pq(ks, k);
    v_pq = parse_pq(vs, v);
    if ((!k_pq && !type_for_bits(parse_int(ks, "key bits", whole), kt)) ||
        (!v_pq && !type_for_bits(parse_int(vs, "value bits", whole), vt)))
      fail(ErrorCode::invalid_argument, "KV format '{}': bits must be 32, 16, 8, 4, 3, 2, pq4, pq2 or pq1", whole);
  } else {
    fail(ErrorCode::invalid_argument,
         "KV format '{}': unknown name '{}' (expected f32, f16, int8, int4, int3, int2, pq4, pq2, pq1 or kXvY such as k8v4)",
         whole, name);
  }
  if (!k_pq) k = default_codec(kt, true);
  if (!v_pq) v = default_codec(vt, false);
}

}  // namespace

int KvCodec::bits() const noexcept {
  switch (type) {
    case KvType::f32: return 32;
    case KvType::f16: return 16;
    case KvType::q8: return 8;
    case KvType::q4: return 4;
    case KvType::q3: return 3;
    case KvType::q2: return 2;
    case KvType::pq: return group == 0 ? 0 : 8 / group;
  }
  return 0;
}

std::uint32_t KvCodec::pack() const noexcept {
  // The axis byte's upper seven bits carry the outliers (codecs written before
  // them read as none); the type byte's top bit byte parameters (builds
  // before them reject the codec as an unknown type rather than misread it).
  return static_cast<std::uint32_t>(type) | (byte_params ? 0x80u : 0u) |
         ((static_cast<std::uint32_t>(axis) | (static_cast<std::uint32_t>(outliers) << 1)) << 8) |
         (static_cast<std::uint32_t>(group) << 16);
}

KvCodec KvCodec::unpack(std::uint32_t packed) {
  const std::uint32_t t = packed & 0x7fu, a = (packed >> 8) & 1u, o = (packed >> 9) & 0x7fu;
  if (t > static_cast<std::uint32_t>(KvType::pq))
    fail(ErrorCode::invalid_argument, "KV codec 0x{:08x}: unknown type {} or axis {}", packed, t, a);
  KvCodec c{static_cast<KvType>(t), static_cast<KvAxis>(a), static_cast<std::uint16_t>(packed >> 16),
            static_cast<std::uint8_t>(o), (packed & 0x80u) != 0};
  if (c.outliers != 0 && !c.scaled())
    fail(ErrorCode::invalid_argument, "KV codec 0x{:08x}: only integer codecs keep outliers", packed);
  if (c.byte_params && !c.scaled())
    fail(ErrorCode::invalid_argument, "KV codec 0x{:08x}: only integer codecs have byte parameters", packed);
  if (c.pq() && (c.axis != KvAxis::token || (c.group != 2 && c.group != 4 && c.group != 8)))
    fail(ErrorCode::invalid_argument, "KV codec 0x{:08x}: pq takes sub-vectors of 2, 4 or 8 channels", packed);
  if (!c.quantized() && (c.axis != KvAxis::token || c.group != 0))
    fail(ErrorCode::invalid_argument, "KV codec 0x{:08x}: float codecs take no axis or group", packed);
  return c;
}

TileLayout tile_layout(const KvCodec& c, int block_tokens, int head_dim) {
  if (block_tokens <= 0 || head_dim <= 0 || head_dim % 8 != 0)
    fail(ErrorCode::unsupported, "KV tile of {} tokens x head_dim {}: head_dim must be a positive multiple of 8",
         block_tokens, head_dim);
  TileLayout t;
  t.tokens = block_tokens;
  t.head_dim = head_dim;
  const auto T = static_cast<std::size_t>(block_tokens), D = static_cast<std::size_t>(head_dim);
  switch (c.type) {
    case KvType::f32: t.row_bytes = D * 4; break;
    case KvType::f16: t.row_bytes = D * 2; break;
    case KvType::pq:
      if (c.group == 0 || D % c.group != 0)
        fail(ErrorCode::invalid_argument, "KV codec pq: sub-vectors of {} channels do not divide head_dim {}", c.group, D);
      t.row_bytes = D / c.group;
      break;
    default: t.row_bytes = D / 8 * static_cast<std::size_t>(c.bits()); break;
  }
  t.code_bytes = T * t.row_bytes;
  t.param_offset = round_up(t.code_bytes, 4);
  if (c.scaled()) {
    if (c.axis == KvAxis::channel) {
      t.n_params = D;
    } else {
      if (c.group % 8 != 0) fail(ErrorCode::invalid_argument, "KV codec group {} is not a multiple of 8", c.group);
      t.n_params = T * D / static_cast<std::size_t>(effective_group(c, head_dim));
    }
    // Rounded to 8 pairs so the SIMD decoders convert them 8 at a time in bounds.
    t.param_stride = round_up(t.n_params, 8);
    t.byte_params = c.byte_params;
    t.param_bytes = c.byte_params ? kernels::kByteParamHeader + t.param_stride * 2 : t.param_stride * 4;
  } else if (c.byte_params) {
    fail(ErrorCode::invalid_argument, "KV codec: only integer codecs have byte parameters");
  }
  t.outlier_offset = t.param_offset + t.param_bytes;
  if (c.outliers != 0) {
    if (!c.scaled()) fail(ErrorCode::invalid_argument, "KV codec: only integer codecs keep outliers");
    if (T * D > 65536)
      fail(ErrorCode::unsupported, "KV outliers: a tile of {} tokens x head_dim {} has more elements than a 16-bit "
           "index reaches (65536)", T, D);
    t.n_outliers = (T * D * c.outliers + 999) / 1000;
  }
  // Codes come first: the 3-bit unpacker reads 4 bytes for its last 3, which
  // then fall on the params (or the padding) of the same tile.
  t.bytes = round_up(t.outlier_offset + 4 * t.n_outliers + (c.scaled() ? 1 : 0), kTileAlign);
  return t;
}

const char* key_rope_name(KeyRope r) noexcept {
  return r == KeyRope::pre ? "pre" : r == KeyRope::block ? "block" : "post";
}

KvFormat KvFormat::parse(std::string_view text) {
  const std::string whole(text);
  std::vector<std::string_view> parts;
  for (std::size_t pos = 0;;) {
    const std::size_t end = text.find(':', pos);
    parts.push_back(text.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos));
    if (end == std::string_view::npos) break;
    pos = end + 1;
  }
  KvFormat f;
  std::string_view name = parts[0];
  std::size_t first_option = 1;
  if (name == "mixed") {  // mixed:hi=NAME:...: the high precision is the base name
    if (parts.size() < 2 || parts[1].substr(0, 3) != "hi=")
      fail(ErrorCode::invalid_argument, "KV format '{}': mixed needs hi=NAME first (e.g. mixed:hi=int8:lo=int2:top=0.2)",
           whole);
    name = parts[1].substr(3);
    first_option = 2;
  }
  parse_name(name, whole, f.k, f.v);
  bool has_lo = false, has_top = false;
  int k_outliers = 0, v_outliers = 0;  // tenths of a percent, applied to the integer codecs at the end
  bool byte_params = false;            // likewise
  std::vector<std::string_view> keys;  // an option given twice would silently lose its first value
  for (std::size_t i = first_option; i < parts.size(); ++i) {
    const std::string_view p = parts[i];
    const std::size_t eq = p.find('=');
    if (eq == std::string_view::npos)
      fail(ErrorCode::invalid_argument, "KV format '{}': option '{}' is not key=value", whole, p);
    const std::string_view key = p.substr(0, eq), val = p.substr(eq + 1);
    if (std::find(keys.begin(), keys.end(), key) != keys.end())
      fail(ErrorCode::invalid_argument, "KV format '{}': option '{}' is given twice", whole, key);
    keys.push_back(key);
    if (key == "window") {
      f.window = parse_int(val, "window", whole);
    } else if (key == "sink") {
      f.sink = parse_int(val, "sink", whole);
    } else if (key == "kaxis") {
      if (!f.k.scaled()) fail(ErrorCode::invalid_argument, "KV format '{}': kaxis needs integer keys", whole);
      if (val == "channel") f.k.axis = KvAxis::channel, f.k.group = 0;
      else if (val == "token") f.k.axis = KvAxis::token;
      else fail(ErrorCode::invalid_argument, "KV format '{}': kaxis must be channel or token, got '{}'", whole, val);
    } else if (key == "kgroup" || key == "vgroup") {
      KvCodec& c = key == "kgroup" ? f.k : f.v;
      if (!c.scaled() || c.axis != KvAxis::token)
        fail(ErrorCode::invalid_argument, "KV format '{}': {} needs per-token integer codes", whole, key);
      const int g = parse_int(val, key, whole);
      if (g == 0 || g % 8 != 0 || g > 4096)
        fail(ErrorCode::invalid_argument, "KV format '{}': {} must be a multiple of 8 up to 4096", whole, key);
      c.group = static_cast<std::uint16_t>(g);
    } else if (key == "rot") {
      if (val != "none" && val != "k" && val != "v" && val != "kv")
        fail(ErrorCode::invalid_argument, "KV format '{}': rot must be none, k, v or kv, got '{}'", whole, val);
      f.rotate_k = val == "k" || val == "kv";
      f.rotate_v = val == "v" || val == "kv";
    } else if (key == "keys") {
      if (val != "post" && val != "pre" && val != "block")
        fail(ErrorCode::invalid_argument, "KV format '{}': keys must be post, pre or block (RoPE), got '{}'", whole, val);
      f.key_rope = val == "pre" ? KeyRope::pre : val == "block" ? KeyRope::block : KeyRope::post;
    } else if (key == "lo") {
      KvFormat lo;
      try {
        parse_name(val, whole, lo.k, lo.v);
      } catch (const Error&) {
        fail(ErrorCode::invalid_argument, "KV format '{}': lo must name an integer or pq format such as int2, k4v2 or pq2, got '{}'",
             whole, val);
      }
      if (!lo.k.quantized() || !lo.v.quantized())
        fail(ErrorCode::invalid_argument, "KV format '{}': lo must name an integer or pq format such as int2, k4v2 or pq2, got '{}'",
             whole, val);
      f.lo_k = lo.k;
      f.lo_v = lo.v;
      has_lo = true;
    } else if (key == "book") {
      if (val.empty()) fail(ErrorCode::invalid_argument, "KV format '{}': book needs a file", whole);
      f.book_path = std::string(val);
    } else if (key == "positions") {
      if (val == "keep") f.close_positions = false;
      else if (val == "close") f.close_positions = true;
      else fail(ErrorCode::invalid_argument, "KV format '{}': positions must be keep or close, got '{}'", whole, val);
    } else if (key == "tail") {
      if (val == "hot") f.cold_tail = false;
      else if (val == "cold") f.cold_tail = true;
      else fail(ErrorCode::invalid_argument, "KV format '{}': tail must be hot or cold, got '{}'", whole, val);
    } else if (key == "rank") {
      if (val == "attention") f.rank = Rank::attention;
      else if (val == "recent") f.rank = Rank::recent;
      else fail(ErrorCode::invalid_argument, "KV format '{}': rank must be attention or recent, got '{}'", whole, val);
    } else if (key == "outliers" || key == "koutliers" || key == "voutliers") {
      if (key == "outliers" ? std::find(keys.begin(), keys.end(), "koutliers") != keys.end() ||
                                  std::find(keys.begin(), keys.end(), "voutliers") != keys.end()
                            : std::find(keys.begin(), keys.end(), "outliers") != keys.end())
        fail(ErrorCode::invalid_argument, "KV format '{}': outliers sets both sides; give it or koutliers/voutliers", whole);
      const std::string v(val);
      char* end = nullptr;
      const double share = std::strtod(v.c_str(), &end);
      const double tenths = share * 1000.0;
      if (v.empty() || end != v.c_str() + v.size() || !(tenths >= 0.5 && tenths < KvCodec::kMaxOutliers + 0.5) ||
          std::abs(tenths - std::round(tenths)) > 1e-6)
        fail(ErrorCode::invalid_argument, "KV format '{}': {} must be a share from 0.001 to 0.127 in steps of 0.001, "
             "got '{}'", whole, key, val);
      const int tenths_int = static_cast<int>(std::lround(tenths));
      if (key != "voutliers") k_outliers = tenths_int;
      if (key != "koutliers") v_outliers = tenths_int;
    } else if (key == "params") {
      if (val != "8" && val != "16")
        fail(ErrorCode::invalid_argument, "KV format '{}': params must be 8 (one-byte scales and mins) or 16 (f16), "
             "got '{}'", whole, val);
      byte_params = val == "8";
    } else if (key == "top" || key == "budget") {
      const std::string v(val);
      char* end = nullptr;
      double& share = key == "top" ? f.top : f.budget;
      share = std::strtod(v.c_str(), &end);
      if (v.empty() || end != v.c_str() + v.size() || !(share > 0.0 && share < 1.0))
        fail(ErrorCode::invalid_argument, "KV format '{}': {} must be a share strictly between 0 and 1, got '{}'", whole,
             key, val);
      has_top = has_top || key == "top";
    } else {
      fail(ErrorCode::invalid_argument,
           "KV format '{}': unknown option '{}' (expected window, sink, kaxis, kgroup, vgroup, rot, keys, lo, top, budget, rank, positions, tail, outliers, koutliers, voutliers, params, book)",
           whole, key);
    }
  }
  if (has_lo != has_top)
    fail(ErrorCode::invalid_argument, "KV format '{}': mixed precision needs both lo=NAME and top=F", whole);
  if (has_lo && (!f.k.quantized() || !f.v.quantized()))
    fail(ErrorCode::invalid_argument, "KV format '{}': mixed precision needs integer high-precision codes", whole);
  if (has_lo && f.lo_v.scaled() && f.v.scaled() && f.lo_v.axis == KvAxis::token && f.v.axis == KvAxis::token)
    f.lo_v.group = f.v.group;
  for (const bool keys_side : {true, false}) {
    const int tenths = keys_side ? k_outliers : v_outliers;
    if (tenths == 0) continue;
    bool any = false;
    for (KvCodec* c : {keys_side ? &f.k : &f.v, keys_side ? &f.lo_k : &f.lo_v}) {
      const bool used = c == &f.k || c == &f.v || has_lo;  // lo codecs only in a mixed format
      if (used && c->scaled()) c->outliers = static_cast<std::uint8_t>(tenths), any = true;
    }
    const bool named = std::find(keys.begin(), keys.end(), keys_side ? "koutliers" : "voutliers") != keys.end();
    if (!any && named)
      fail(ErrorCode::invalid_argument, "KV format '{}': {} needs integer {} (int8 .. int2)", whole,
           keys_side ? "koutliers" : "voutliers", keys_side ? "keys" : "values");
  }
  if ((k_outliers != 0 || v_outliers != 0) && f.k.outliers == 0 && f.v.outliers == 0)
    fail(ErrorCode::invalid_argument, "KV format '{}': outliers needs integer codes (int8 .. int2)", whole);
  if (byte_params) {
    bool any = false;
    for (KvCodec* c : {&f.k, &f.v, &f.lo_k, &f.lo_v})
      if (c->scaled() && (c == &f.k || c == &f.v || has_lo)) c->byte_params = true, any = true;
    if (!any) fail(ErrorCode::invalid_argument, "KV format '{}': params=8 needs integer codes (int8 .. int2)", whole);
  }
  if (f.uses_pq() && f.book_path.empty())
    fail(ErrorCode::invalid_argument, "KV format '{}': pq needs book=FILE (a codebook of qkvshare calibrate)", whole);
  if (!f.uses_pq() && !f.book_path.empty())
    fail(ErrorCode::invalid_argument, "KV format '{}': book applies to pq formats only", whole);
  if (f.uses_pq() && (f.rotate_k || f.rotate_v))
    fail(ErrorCode::invalid_argument, "KV format '{}': pq codebooks are learned on unrotated rows (no rot)", whole);
  if (f.key_rope != KeyRope::post && f.rotate_k)
    fail(ErrorCode::invalid_argument, "KV format '{}': keys={} does not combine with rotated keys (rot=k or kv)", whole,
         key_rope_name(f.key_rope));
  if (f.uses_pq()) {
    try {
      f.book = KvCodebook::shared(f.book_path);
    } catch (const Error& e) {
      fail(e.code(), "KV format '{}': {}", whole, e.what());
    }
  }
  if (f.close_positions && !f.evicts())
    fail(ErrorCode::invalid_argument, "KV format '{}': positions applies to dropping (budget)", whole);
  if (f.cold_tail && !f.k.quantized() && !f.v.quantized())
    fail(ErrorCode::invalid_argument, "KV format '{}': tail=cold needs quantized codes (int8 .. int2, pq)", whole);
  if (f.cold_tail && f.window > 0)
    fail(ErrorCode::invalid_argument,
         "KV format '{}': tail=cold ships the partly filled block coded, window keeps the newest tokens hot: give one",
         whole);
  if (f.rank != Rank::attention && !f.observes())
    fail(ErrorCode::invalid_argument, "KV format '{}': rank applies to mixed precision (lo, top) or dropping (budget)",
         whole);
  if (f.window > (1 << 24) || f.sink > (1 << 24))
    fail(ErrorCode::invalid_argument, "KV format '{}': window/sink too large", whole);
  return f;
}

std::string KvFormat::to_string() const {
  std::string s;
  const KvFormat plain = [&] {
    KvFormat d;
    d.k = k.pq() ? k : default_codec(k.type, true);
    d.v = v.pq() ? v : default_codec(v.type, false);
    return d;
  }();
  if (k == v && k.pq()) {
    s = side_name(k);
  } else if (k.type == v.type && !k.pq()) {
    s = k.type == KvType::f32 ? "f32" : k.type == KvType::f16 ? "f16" : fmt::format("int{}", k.bits());
  } else {
    s = fmt::format("k{}v{}", side_name(k), side_name(v));
  }
  if (window != 0) s += fmt::format(":window={}", window);
  if (sink != 0) s += fmt::format(":sink={}", sink);
  if (k.axis != plain.k.axis) s += k.axis == KvAxis::token ? ":kaxis=token" : ":kaxis=channel";
  if (k.axis == KvAxis::token && k.group != plain.k.group && k.group != 0) s += fmt::format(":kgroup={}", k.group);
  if (v.group != plain.v.group && v.group != 0) s += fmt::format(":vgroup={}", v.group);
  if (rotate_k || rotate_v) s += rotate_k && rotate_v ? ":rot=kv" : rotate_k ? ":rot=k" : ":rot=v";
  if (key_rope != KeyRope::post) s += fmt::format(":keys={}", key_rope_name(key_rope));
  if (mixed()) {
    s += lo_k == lo_v && lo_k.pq()               ? fmt::format(":lo={}", side_name(lo_k))
         : lo_k.type == lo_v.type && !lo_k.pq() ? fmt::format(":lo=int{}", lo_k.bits())
                                                : fmt::format(":lo=k{}v{}", side_name(lo_k), side_name(lo_v));
    s += fmt::format(":top={}", top);
  }
  if (evicts()) s += fmt::format(":budget={}", budget);
  if (rank == Rank::recent) s += ":rank=recent";
  if (close_positions) s += ":positions=close";
  if (cold_tail) s += ":tail=cold";
  // One value for every integer codec prints as outliers=; else per side.
  const int ko = std::max(k.outliers, lo_k.outliers), vo = std::max(v.outliers, lo_v.outliers);
  const bool k_int = k.scaled() || (mixed() && lo_k.scaled()), v_int = v.scaled() || (mixed() && lo_v.scaled());
  if (ko != 0 && (ko == vo || !v_int)) s += fmt::format(":outliers={}", ko / 1000.0);
  else if (vo != 0 && ko == 0 && !k_int) s += fmt::format(":outliers={}", vo / 1000.0);
  else {
    if (ko != 0) s += fmt::format(":koutliers={}", ko / 1000.0);
    if (vo != 0) s += fmt::format(":voutliers={}", vo / 1000.0);
  }
  if (k.byte_params || v.byte_params || lo_k.byte_params || lo_v.byte_params) s += ":params=8";
  if (!book_path.empty()) s += ":book=" + book_path;
  return s;
}

void KvFormat::validate(const KvShape& shape, int block_tokens) const {
  if (block_tokens <= 0 || (block_tokens & (block_tokens - 1)) != 0)
    fail(ErrorCode::invalid_argument, "KV block size {} is not a power of two", block_tokens);
  tile_layout(k, block_tokens, shape.head_dim);
  tile_layout(v, block_tokens, shape.head_dim);
  if (mixed()) {
    tile_layout(lo_k, block_tokens, shape.head_dim);
    tile_layout(lo_v, block_tokens, shape.head_dim);
  }
  if (uses_pq() && (!book || !book->fits(shape)))
    fail(ErrorCode::invalid_argument, "KV format '{}': the codebook is for {} layers x {} KV heads x head_dim {}, not this model's {} x {} x {}",
         to_string(), book ? book->header().n_layers : 0, book ? book->header().n_kv_heads : 0,
         book ? book->header().head_dim : 0, shape.n_layers, shape.n_kv_heads, shape.head_dim);
  for (const KvCodec* c : {&k, &v, &lo_k, &lo_v})
    if (c->pq() && c->group != book->sub())
      fail(ErrorCode::invalid_argument, "KV format '{}': pq{} needs a codebook of {}-channel sub-vectors; '{}' has {}",
           to_string(), c->bits(), c->group, book_path, book->sub());
  if ((k.pq() || (mixed() && lo_k.pq())) && book->header().keys != key_rope)
    fail(ErrorCode::invalid_argument, "KV format '{}': codebook '{}' was learned on keys={} rows; the format stores "
         "keys={} (keys={} here, or calibrate --keys {})", to_string(), book_path, key_rope_name(book->header().keys),
         key_rope_name(key_rope), key_rope_name(book->header().keys), key_rope_name(key_rope));
  if ((k.pq() || (mixed() && lo_k.pq())) && key_rope == KeyRope::block && book->header().block_tokens != block_tokens) {
    if (book->header().block_tokens == 0)
      fail(ErrorCode::invalid_argument, "KV format '{}': codebook '{}' (keys=block, file version 2) does not record the "
           "block size its keys are relative to; calibrate it again with --keys block --block-tokens {}",
           to_string(), book_path, block_tokens);
    fail(ErrorCode::invalid_argument, "KV format '{}': codebook '{}' was learned on keys relative to {}-token blocks; "
         "this pool's blocks hold {} tokens (calibrate --keys block --block-tokens {})", to_string(), book_path,
         book->header().block_tokens, block_tokens, block_tokens);
  }
  if ((rotate_k || rotate_v) && (shape.head_dim & (shape.head_dim - 1)) != 0)
    fail(ErrorCode::unsupported, "KV format '{}': Hadamard rotation needs a power-of-two head_dim, got {}",
         to_string(), shape.head_dim);
}

double KvFormat::cold_bits(int block_tokens, int head_dim) const {
  const TileLayout tk = tile_layout(k, block_tokens, head_dim), tv = tile_layout(v, block_tokens, head_dim);
  const double elems = 2.0 * block_tokens * head_dim;
  return static_cast<double>(tk.stored_bytes() + tv.stored_bytes()) * 8.0 / elems;
}

bool KvFormat::block_is_hot(int block, int tokens, int block_tokens) const noexcept {
  const long long first = static_cast<long long>(block) * block_tokens, end = first + block_tokens;
  if (end > tokens) return true;                 // partly filled tail
  if (first < sink) return true;                 // attention sinks
  return end > static_cast<long long>(tokens) - window;  // recent window
}

int KvFormat::kept_blocks(int cold) const noexcept {
  if (!mixed()) return cold;
  return std::min(cold, static_cast<int>(std::ceil(top * cold - 1e-9)));
}

std::size_t KvFormat::context_bytes(const KvShape& shape, int block_tokens, int tokens) const {
  const auto bytes = [&](const KvCodec& c) { return tile_layout(c, block_tokens, shape.head_dim).stored_bytes(); };
  const std::size_t tiles = static_cast<std::size_t>(shape.n_layers) * static_cast<std::size_t>(shape.n_kv_heads);
  const int blocks = (tokens + block_tokens - 1) / block_tokens;
  int hot = 0;
  for (int b = 0; b < blocks; ++b) hot += block_is_hot(b, tokens, block_tokens);
  const int cold = blocks - hot, kept = kept_blocks(cold);
  const std::size_t per_hot = bytes(hot_codec(k)) + bytes(hot_codec(v)), per_cold = bytes(k) + bytes(v);
  const std::size_t per_lo = mixed() ? bytes(lo_k) + bytes(lo_v) : per_cold;
  return tiles * (static_cast<std::size_t>(hot) * per_hot + static_cast<std::size_t>(kept) * per_cold +
                  static_cast<std::size_t>(cold - kept) * per_lo);
}

}  // namespace qkvshare
