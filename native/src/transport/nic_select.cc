#include "nic_select.hpp"

#include <dirent.h>
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "uccl_moe/env.hpp"
#include "uccl_moe/error.hpp"

namespace uccl_moe::detail {

namespace {

constexpr int kMaxCpu = 1 << 16;  ///< bound of a CPU number in a list (Linux NR_CPUS is at most 8192)

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!f || !std::getline(f, s)) return "";
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

int read_int(const std::string& path, int dflt) {
  const std::string s = read_line(path);
  if (s.empty()) return dflt;
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 0);
  return end && *end == '\0' ? int(v) : dflt;
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  if (DIR* d = opendir(path.c_str())) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') out.emplace_back(e->d_name);
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string real_path(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) ? std::string(buf) : std::string();
}

bool is_bdf(const std::string& s) {  // dddd:bb:dd.f
  unsigned dom, bus, dev, fn;
  char extra;
  return s.size() == 12 && std::sscanf(s.c_str(), "%4x:%2x:%2x.%1x%c", &dom, &bus, &dev, &fn, &extra) == 4;
}

/// The PCI path of a device directory under <root>/devices: root complex ("pci0000:00") first, then every bridge.
std::vector<std::string> pci_path_of(const std::string& real_root, const std::string& dev_dir) {
  std::vector<std::string> out;
  const std::string real = real_path(dev_dir);
  const std::string prefix = real_root + "/devices/";
  if (real.rfind(prefix, 0) != 0) return out;
  std::stringstream ss(real.substr(prefix.size()));
  std::string part;
  while (std::getline(ss, part, '/')) {
    if (part.rfind("pci", 0) == 0 && out.empty()) out.push_back(part);
    else if (is_bdf(part) && !out.empty()) out.push_back(part);
  }
  if (out.size() < 2) out.clear();
  return out;
}

std::string port_state(const std::string& text) {  // "4: ACTIVE" -> "ACTIVE"
  const size_t colon = text.find(": ");
  return colon == std::string::npos ? text : text.substr(colon + 2);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

int parse_rank(const std::string& text, const std::string& var, const std::string& whole) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || !end || *end != '\0' || v < 0 || v > 4095)
    UCCL_THROW(kInvalidUsage, "%s=\"%s\": \"%s\" is not a local rank (0..4095) in a rank:value pair", var.c_str(),
               whole.c_str(), text.c_str());
  return int(v);
}

/// The entry of a per-local-rank list for `local_rank`: positional ("a<sep>b<sep>c") or pairs ("0:a<sep>2:c").
/// Returns {found, text}. A single entry without ':' applies to every rank.
std::pair<bool, std::string> entry_for_rank(const std::string& text, char sep, int local_rank, const std::string& var,
                                            const char* hint) {
  const std::vector<std::string> parts = split(text, sep);
  size_t pairs = 0;
  for (const std::string& p : parts) pairs += p.find(':') != std::string::npos;
  if (pairs == 0) {
    if (parts.size() == 1) return {true, trim(parts[0])};
    if (size_t(local_rank) >= parts.size())
      UCCL_THROW(kInvalidUsage, "%s=\"%s\" lists %zu entries, one per local rank, but local rank %d has none; give "
                 "one entry per local rank on the node, or rank:value pairs (%s)", var.c_str(), text.c_str(),
                 parts.size(), local_rank, hint);
    return {true, trim(parts[size_t(local_rank)])};
  }
  if (pairs != parts.size())
    UCCL_THROW(kInvalidUsage, "%s=\"%s\" mixes positional entries and rank:value pairs; use one form (%s)", var.c_str(),
               text.c_str(), hint);
  std::set<int> seen;
  std::pair<bool, std::string> found{false, ""};
  for (const std::string& p : parts) {
    const size_t colon = p.find(':');
    const int r = parse_rank(trim(p.substr(0, colon)), var, text);
    if (!seen.insert(r).second)
      UCCL_THROW(kInvalidUsage, "%s=\"%s\" names local rank %d twice", var.c_str(), text.c_str(), r);
    if (r == local_rank) found = {true, trim(p.substr(colon + 1))};
  }
  return found;
}

bool valid_device_name(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) return false;
  return true;
}

struct Key {  // what "closer" means: PCIe hops, then the same NUMA node
  int dist = kPcieFar;
  int numa_miss = 1;
  bool operator<(const Key& o) const { return std::tie(dist, numa_miss) < std::tie(o.dist, o.numa_miss); }
  bool operator==(const Key& o) const { return dist == o.dist && numa_miss == o.numa_miss; }
};

Key key_of(const std::vector<std::string>& gpu_path, int gpu_numa, const SysfsRdmaDevice& d) {
  Key k;
  k.dist = pcie_distance(gpu_path, d.pci_path);
  k.numa_miss = (gpu_numa >= 0 && d.numa_node >= 0 && gpu_numa == d.numa_node) ? 0 : 1;
  return k;
}

/// Indices of the devices closest to a GPU (sorted by PCI address, then name, as `devs` is).
std::vector<size_t> closest(const std::vector<SysfsRdmaDevice>& devs, const std::vector<std::string>& gpu_path,
                            int gpu_numa, Key* best_out) {
  Key best{kPcieFar + 1, 2};
  std::vector<size_t> out;
  for (size_t i = 0; i < devs.size(); ++i) {
    const Key k = key_of(gpu_path, gpu_numa, devs[i]);
    if (k < best) {
      best = k;
      out.clear();
    }
    if (k == best) out.push_back(i);
  }
  if (best_out) *best_out = best;
  return out;
}

}  // namespace

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& s : names) out += (out.empty() ? "" : ", ") + s;
  return out;
}

const char* nic_family_name(NicFamily f) {
  switch (f) {
    case NicFamily::kEfa: return "efa";
    case NicFamily::kVerbs: return "ibverbs";
    default: return "any";
  }
}

int roce_gid_preference(const uint8_t raw[16]) {
  static const uint8_t kZero[16] = {0};
  static const uint8_t kV4Mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(raw, kZero, 16) == 0) return -1;         // unpopulated entry
  if (raw[0] == 0xfe && (raw[1] & 0xc0) == 0x80) return -1;  // link-local: never routes
  return std::memcmp(raw, kV4Mapped, 12) == 0 ? 0 : raw[0] == 0xfd ? 1 : 2;
}

bool is_efa_name(const std::string& name) { return name.rfind("efa", 0) == 0 || name.rfind("rdmap", 0) == 0; }

std::vector<SysfsRdmaDevice> list_rdma_devices(const std::string& sysfs_root, int port) {
  const std::string real_root = real_path(sysfs_root);
  std::vector<SysfsRdmaDevice> out;
  const std::string cls = sysfs_root + "/class/infiniband/";
  for (const std::string& name : list_dir(cls)) {
    SysfsRdmaDevice d;
    d.name = name;
    d.efa = is_efa_name(name);
    const std::string dev_dir = cls + name + "/device";
    d.pci_path = pci_path_of(real_root, dev_dir);
    if (!d.pci_path.empty()) d.pci_addr = d.pci_path.back();
    d.numa_node = read_int(dev_dir + "/numa_node", -1);
    const std::string p = cls + name + "/ports/" + std::to_string(port) + "/";
    d.port_state = port_state(read_line(p + "state"));
    d.link_layer = read_line(p + "link_layer");
    d.rate = read_line(p + "rate");
    out.push_back(std::move(d));
  }
  std::stable_sort(out.begin(), out.end(), [](const SysfsRdmaDevice& a, const SysfsRdmaDevice& b) {
    return std::tie(a.pci_addr, a.name) < std::tie(b.pci_addr, b.name);
  });
  return out;
}

std::vector<SysfsGpu> list_gpus(const std::string& sysfs_root) {
  const std::string real_root = real_path(sysfs_root);
  std::vector<SysfsGpu> out;
  const std::string bus = sysfs_root + "/bus/pci/devices/";
  for (const std::string& bdf : list_dir(bus)) {
    const int vendor = read_int(bus + bdf + "/vendor", 0);
    const int cls = read_int(bus + bdf + "/class", 0) >> 8;
    // PCI class codes: 0x0300 VGA, 0x0302 3D controller (H100/H200), 0x0380 display, 0x1200 processing
    // accelerator (MI300X) (PCI Code and ID Assignment Specification, base classes 03h and 12h).
    const bool gpu_class = cls == 0x0300 || cls == 0x0302 || cls == 0x0380 || cls == 0x1200;
    if (!gpu_class || (vendor != 0x10de && vendor != 0x1002)) continue;
    SysfsGpu g;
    g.pci_addr = bdf;
    g.pci_path = pci_path_of(real_root, bus + bdf);
    g.numa_node = read_int(bus + bdf + "/numa_node", -1);
    g.vendor = vendor == 0x10de ? "nvidia" : "amd";
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<SysfsGid> list_gids(const std::string& sysfs_root, const std::string& device, int port) {
  std::vector<SysfsGid> out;
  const std::string p = sysfs_root + "/class/infiniband/" + device + "/ports/" + std::to_string(port) + "/";
  std::vector<int> idx;
  for (const std::string& s : list_dir(p + "gids")) idx.push_back(std::atoi(s.c_str()));
  std::sort(idx.begin(), idx.end());
  for (int i : idx) {
    SysfsGid g;
    g.index = i;
    g.gid = read_line(p + "gids/" + std::to_string(i));
    if (g.gid.empty() || g.gid == "0000:0000:0000:0000:0000:0000:0000:0000") continue;
    g.type = read_line(p + "gid_attrs/types/" + std::to_string(i));
    g.ndev = read_line(p + "gid_attrs/ndevs/" + std::to_string(i));
    out.push_back(std::move(g));
  }
  return out;
}

int netdev_mtu(const std::string& sysfs_root, const std::string& ndev) {
  if (ndev.empty()) return -1;
  return read_int(sysfs_root + "/class/net/" + ndev + "/mtu", -1);
}

std::string numa_cpulist(const std::string& sysfs_root, int node) {
  if (node < 0) return "";
  return read_line(sysfs_root + "/devices/system/node/node" + std::to_string(node) + "/cpulist");
}

std::string normalize_pci_bus_id(const std::string& text) {
  const std::string t = trim(text);
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  char extra = 0;
  int n = 0;
  if (std::count(t.begin(), t.end(), ':') == 2)
    n = std::sscanf(t.c_str(), "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &extra);
  else if (std::count(t.begin(), t.end(), ':') == 1)
    n = 1 + std::sscanf(t.c_str(), "%x:%x.%x%c", &bus, &dev, &fn, &extra);
  if (n != 4 || dom > 0xffff || bus > 0xff || dev > 0x1f || fn > 7)
    UCCL_THROW(kInvalidUsage, "\"%s\" is not a PCI bus id (expected domain:bus:device.function, e.g. 0000:53:00.0)",
               text.c_str());
  char buf[16];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
  return buf;
}

int pcie_distance(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  if (a.empty() || b.empty() || a[0] != b[0]) return kPcieFar;
  size_t common = 0;
  while (common < a.size() && common < b.size() && a[common] == b[common]) ++common;
  return int(a.size() - common + b.size() - common);
}

std::vector<std::string> hca_for_rank(const std::string& text, int local_rank) {
  const std::string t = trim(text);
  if (t.empty() || t == "auto") return {};
  const auto [found, entry] =
      entry_for_rank(t, ',', local_rank, "UCCL_MOE_IB_HCA", "e.g. mlx5_0,mlx5_1,... or 0:mlx5_0,1:mlx5_3");
  if (!found || entry == "auto") return {};
  std::vector<std::string> names;
  for (const std::string& n : split(entry, '+')) {
    const std::string name = trim(n);
    if (!valid_device_name(name))
      UCCL_THROW(kInvalidUsage, "UCCL_MOE_IB_HCA=\"%s\": \"%s\" is not an RDMA device name (e.g. mlx5_0, bnxt_re3, "
                 "rdmap79s0; join several with '+')", text.c_str(), name.c_str());
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

std::vector<int> parse_cpu_list(const std::string& text, const std::string& var) {
  std::vector<int> cpus;
  for (const std::string& raw : split(text, ',')) {
    const std::string item = trim(raw);
    if (item.empty()) continue;
    int a = 0, b = 0;
    char extra = 0;
    if (std::sscanf(item.c_str(), "%d-%d%c", &a, &b, &extra) == 2 && a >= 0 && b >= a && b < kMaxCpu) {
      for (int c = a; c <= b; ++c) cpus.push_back(c);
    } else if (std::sscanf(item.c_str(), "%d%c", &a, &extra) == 1 && a >= 0 && a < kMaxCpu &&
               item.find('-') == std::string::npos) {
      cpus.push_back(a);
    } else {
      UCCL_THROW(kInvalidUsage, "%s=\"%s\" is invalid: \"%s\" is not a CPU or range (expected a CPU list like "
                 "0-3,8)", var.c_str(), text.c_str(), item.c_str());
    }
  }
  return cpus;
}

ProxyCpuSpec proxy_cpus_for_rank(const std::string& text, int local_rank) {
  const std::string t = trim(text);
  ProxyCpuSpec spec;
  if (t.empty() || t == "auto") return spec;
  const auto [found, entry] =
      entry_for_rank(t, ';', local_rank, "UCCL_MOE_PROXY_CPUS", "e.g. \"0-3;8-11\" or \"0:0-3;1:8-11\"");
  if (!found || entry.empty() || entry == "auto") return spec;
  if (entry == "none") {
    spec.mode = ProxyCpuSpec::Mode::kNone;
    return spec;
  }
  spec.mode = ProxyCpuSpec::Mode::kList;
  spec.cpus = parse_cpu_list(entry, "UCCL_MOE_PROXY_CPUS");
  if (spec.cpus.empty())
    UCCL_THROW(kInvalidUsage, "UCCL_MOE_PROXY_CPUS=\"%s\" gives local rank %d no CPU", text.c_str(), local_rank);
  return spec;
}

ProxyPinning plan_proxy_pinning(const ProxyCpuSpec& spec, const std::string& nic_numa_cpus,
                                const std::vector<int>& allowed) {
  ProxyPinning p;
  if (spec.mode == ProxyCpuSpec::Mode::kList) {
    p.cpus = spec.cpus;
    return p;
  }
  if (spec.mode == ProxyCpuSpec::Mode::kNone) return p;
  if (nic_numa_cpus.empty()) {
    p.note = "no NIC NUMA node known";
    return p;
  }
  for (int c : parse_cpu_list(nic_numa_cpus, "NUMA node cpulist"))
    if (allowed.empty() || std::find(allowed.begin(), allowed.end(), c) != allowed.end()) p.cpus.push_back(c);
  p.whole_set = !p.cpus.empty();
  if (p.cpus.empty())
    p.note = "the NIC's NUMA node CPUs (" + nic_numa_cpus + ") are outside this process's CPU set";
  return p;
}

NicChoice choose_nics(const NicRequest& req) {
  NicChoice c;
  c.sysfs_root = req.sysfs_root;
  const auto in_family = [&](const std::string& name) {
    return req.family == NicFamily::kAny || (req.family == NicFamily::kEfa) == is_efa_name(name);
  };
  std::vector<SysfsRdmaDevice> all = list_rdma_devices(req.sysfs_root, req.port);
  std::map<std::string, const SysfsRdmaDevice*> by_name;
  for (const SysfsRdmaDevice& d : all) by_name[d.name] = &d;
  const auto listed = [&](const std::string& name) {
    return req.available.empty() || std::find(req.available.begin(), req.available.end(), name) != req.available.end();
  };
  if (!req.gpu_pci_bus_id.empty()) c.gpu_pci_bus_id = normalize_pci_bus_id(req.gpu_pci_bus_id);
  const auto set_numa = [&](const SysfsRdmaDevice* d, int gpu_numa) {
    c.numa_node = d && d->numa_node >= 0 ? d->numa_node : gpu_numa;
    c.numa_cpus = numa_cpulist(req.sysfs_root, c.numa_node);
  };

  // 1. Explicit names for this local rank.
  const std::vector<std::string> want = hca_for_rank(req.hca, req.local_rank);
  if (!want.empty()) {
    std::vector<std::string> known;  // every name the verbs layer or sysfs knows
    for (const std::string& n : req.available) known.push_back(n);
    for (const SysfsRdmaDevice& d : all)
      if (std::find(known.begin(), known.end(), d.name) == known.end()) known.push_back(d.name);
    for (const std::string& n : want) {
      if (std::find(known.begin(), known.end(), n) == known.end())
        UCCL_THROW(kInvalidUsage, "UCCL_MOE_IB_HCA names %s for local rank %d, but this host has %s", n.c_str(),
                   req.local_rank, known.empty() ? "no RDMA devices" : ("only: " + join_names(known)).c_str());
      if (!in_family(n))
        UCCL_THROW(kInvalidUsage, "UCCL_MOE_IB_HCA names %s for local rank %d, which is %s device; the %s transport "
                   "takes %s devices (set UCCL_MOE_TRANSPORT to match, or name a device of this family)", n.c_str(),
                   req.local_rank, is_efa_name(n) ? "an EFA" : "a non-EFA", nic_family_name(req.family),
                   req.family == NicFamily::kEfa ? "EFA (efa*, rdmap*)" : "non-EFA");
    }
    c.devices = want;
    c.explicit_choice = true;
    auto it = by_name.find(want[0]);
    const SysfsRdmaDevice* d0 = it == by_name.end() ? nullptr : it->second;
    set_numa(d0, -1);
    c.reason = "UCCL_MOE_IB_HCA entry for local rank " + std::to_string(req.local_rank);
    return c;
  }

  // 2. Devices of the family that sysfs knows with an active port (and the verbs layer lists, when given).
  std::vector<SysfsRdmaDevice> active, inactive;
  for (const SysfsRdmaDevice& d : all) {
    if (!in_family(d.name) || !listed(d.name)) continue;
    (d.port_state == "ACTIVE" ? active : inactive).push_back(d);
  }
  if (active.empty()) {
    // No sysfs topology for this family (a container without /sys/class/infiniband, or a test's fake device list):
    // the verbs layer's names, rotated by local rank so ranks spread over them.
    std::vector<std::string> names;
    for (const std::string& n : req.available)
      if (in_family(n)) names.push_back(n);
    for (const SysfsRdmaDevice& d : inactive)
      if (std::find(names.begin(), names.end(), d.name) == names.end()) names.push_back(d.name);
    if (names.empty()) {
      c.reason = std::string("no ") + nic_family_name(req.family) + " RDMA device found";
      return c;
    }
    const size_t first = size_t(req.local_rank) % names.size();
    for (size_t i = 0; i < names.size(); ++i) c.fallbacks.push_back(names[(first + i) % names.size()]);
    c.devices = {c.fallbacks.front()};
    c.fallbacks.erase(c.fallbacks.begin());
    set_numa(by_name.count(c.devices[0]) ? by_name[c.devices[0]] : nullptr, -1);
    c.reason = inactive.empty() ? "no PCI topology in sysfs: round robin by local rank"
                                : "no device with an active port in sysfs: trying each, from local rank's turn";
    return c;
  }

  // 3. Our GPU, and every GPU of the host (the ones that share our closest set split it).
  std::vector<SysfsGpu> gpus = list_gpus(req.sysfs_root);
  std::sort(gpus.begin(), gpus.end(), [](const SysfsGpu& a, const SysfsGpu& b) { return a.pci_addr < b.pci_addr; });
  int me = -1;
  bool assumed = false;
  if (!c.gpu_pci_bus_id.empty()) {
    for (size_t i = 0; i < gpus.size(); ++i)
      if (gpus[i].pci_addr == c.gpu_pci_bus_id) me = int(i);
    if (me < 0) {  // a GPU sysfs does not list as one (odd class): take its path directly
      SysfsGpu g;
      g.pci_addr = c.gpu_pci_bus_id;
      const std::string dir = req.sysfs_root + "/bus/pci/devices/" + g.pci_addr;
      g.pci_path = pci_path_of(real_path(req.sysfs_root), dir);
      g.numa_node = read_int(dir + "/numa_node", -1);
      gpus.push_back(g);
      me = int(gpus.size() - 1);
    }
  } else if (size_t(req.local_rank) < gpus.size()) {
    me = req.local_rank;
    assumed = true;
    c.gpu_pci_bus_id = gpus[size_t(me)].pci_addr;
  }

  if (me < 0) {  // no GPU to measure from: spread ranks over the devices, as many per rank as they divide
    const size_t k = std::max<size_t>(1, gpus.empty() ? 1 : active.size() / gpus.size());
    const size_t first = (size_t(req.local_rank) * k) % active.size();
    for (size_t i = 0; i < k; ++i) c.devices.push_back(active[(first + i) % active.size()].name);
    for (const SysfsRdmaDevice& d : active)
      if (std::find(c.devices.begin(), c.devices.end(), d.name) == c.devices.end()) c.fallbacks.push_back(d.name);
    set_numa(by_name[c.devices[0]], -1);
    c.reason = "GPU unknown: round robin by local rank over " + std::to_string(active.size()) + " active devices";
    return c;
  }

  const SysfsGpu& g = gpus[size_t(me)];
  Key best;
  const std::vector<size_t> mine = closest(active, g.pci_path, g.numa_node, &best);
  std::vector<std::string> sharers;  // GPUs whose closest set is ours, by PCI address
  for (const SysfsGpu& o : gpus)
    if (closest(active, o.pci_path, o.numa_node, nullptr) == mine) sharers.push_back(o.pci_addr);
  std::sort(sharers.begin(), sharers.end());
  const size_t pos = size_t(std::find(sharers.begin(), sharers.end(), g.pci_addr) - sharers.begin());
  const size_t k = mine.size() / sharers.size();
  if (best.dist == kPcieFar) {
    // Nothing on the GPU's PCIe root (its own NICs are down or absent): one device, spread by the GPU's index.
    c.devices.push_back(active[mine[size_t(me) % mine.size()]].name);
  } else if (k >= 1) {
    for (size_t i = 0; i < k; ++i) c.devices.push_back(active[mine[pos * k + i]].name);
  } else {
    c.devices.push_back(active[mine[pos % mine.size()]].name);
  }
  // Fallbacks: the rest of the active devices, closest first.
  std::vector<std::pair<Key, std::string>> rest;
  for (const SysfsRdmaDevice& d : active)
    if (std::find(c.devices.begin(), c.devices.end(), d.name) == c.devices.end())
      rest.emplace_back(key_of(g.pci_path, g.numa_node, d), d.name);
  std::stable_sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& r : rest) c.fallbacks.push_back(r.second);
  set_numa(by_name[c.devices[0]], g.numa_node);
  c.pcie_distance = best.dist == kPcieFar ? -1 : best.dist;
  c.reason = format("GPU %s%s: %s", g.pci_addr.c_str(), assumed ? " (assumed from the local rank)" : "",
                    best.dist == kPcieFar
                        ? (best.numa_miss ? "no device on its PCIe root or NUMA node" : "same NUMA node, other PCIe root")
                        : format("%d PCIe hops%s", best.dist, best.numa_miss ? "" : ", same NUMA node").c_str());
  if (mine.size() > 1 || sharers.size() > 1)
    c.reason += format("; %zu equally close device(s) shared by %zu GPU(s)", mine.size(), sharers.size());
  return c;
}

NicChoice choose_transport_nics(const TransportContext& ctx, NicFamily family,
                                const std::vector<std::string>& available) {
  NicRequest r;
  r.sysfs_root = env::SYSFS_ROOT();
  r.family = family;
  r.gpu_pci_bus_id = ctx.gpu_pci_bus_id;
  r.local_rank = ctx.local_rank;
  r.hca = env::IB_HCA();
  r.available = available;
  r.port = int(env::IB_PORT());
  return choose_nics(r);
}

std::vector<std::string> nic_open_order(const NicChoice& c) {
  std::vector<std::string> out = c.devices;
  out.insert(out.end(), c.fallbacks.begin(), c.fallbacks.end());
  return out;
}

TransportNic transport_nic(const NicChoice& c, const std::string& opened) {
  TransportNic t;
  t.reason = c.reason;
  if (std::find(c.devices.begin(), c.devices.end(), opened) != c.devices.end()) {
    t.devices = c.devices;
    t.numa_node = c.numa_node;
    t.numa_cpus = c.numa_cpus;
    return t;
  }
  t.devices = {opened};
  t.reason += "; " + (c.devices.empty() ? std::string("none chosen") : join_names(c.devices) + " did not open") +
              ", using fallback " + opened;
  for (const SysfsRdmaDevice& d : list_rdma_devices(c.sysfs_root))
    if (d.name == opened) t.numa_node = d.numa_node;
  t.numa_cpus = numa_cpulist(c.sysfs_root, t.numa_node);
  return t;
}

}  // namespace uccl_moe::detail
