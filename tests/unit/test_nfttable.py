"""``NftTable``: a table written anew replaces what is there; in place, it keeps every object
both tables have, so its base chains and their hooks."""

from __future__ import annotations

from proxy.util.nfttable import NftTable, elements

OBJECTS = [
    ("chain", "fw_0", "", "    ip saddr != { 10.0.0.0/8 } drop\n"),
    ("map", "firewall", "type ipv4_addr . inet_proto . inet_service : verdict;",
     elements(["10.96.0.1 . tcp . 80 : jump fw_0"])),
    ("set", "vips", "type ipv4_addr;", elements([])),
    ("chain", "guard", "type filter hook prerouting priority mangle; policy accept;",
     "    ip daddr . meta l4proto . tcp dport vmap @firewall\n"),
]


def test_rendered_whole_and_anew() -> None:
    t = NftTable.render("ip", "kpx_t", OBJECTS)
    assert t.ref == "ip kpx_t"
    assert t.filled == (
        "table ip kpx_t {\n"
        "  chain fw_0 {\n    ip saddr != { 10.0.0.0/8 } drop\n  }\n"
        "  map firewall { type ipv4_addr . inet_proto . inet_service : verdict;"
        " elements = { 10.96.0.1 . tcp . 80 : jump fw_0 }; }\n"
        "  set vips { type ipv4_addr; }\n"
        "  chain guard {\n    type filter hook prerouting priority mangle; policy accept;\n"
        "    ip daddr . meta l4proto . tcp dport vmap @firewall\n  }\n"
        "}\n")
    assert t.anew() == "table ip kpx_t\ndelete table ip kpx_t\n" + t.filled
    assert t.names == {("chain", "fw_0"), ("map", "firewall"), ("set", "vips"),
                       ("chain", "guard")}


def test_in_place_declares_flushes_deletes_what_went_then_fills() -> None:
    t = NftTable.render("ip", "kpx_t", OBJECTS)
    before = t.names | {("chain", "fw_1"), ("set", "old"), ("chain", "fw_2")}
    text = t.in_place(before)
    skeleton, rest = text.split("}\n}\n", 1)
    assert skeleton + "}\n}\n" == (
        "table ip kpx_t {\n  chain fw_0 {\n  }\n"
        "  map firewall { type ipv4_addr . inet_proto . inet_service : verdict; }\n"
        "  set vips { type ipv4_addr; }\n"
        "  chain guard {\n    type filter hook prerouting priority mangle; policy accept;\n"
        "  }\n}\n")
    # Every object of ours emptied, then what went deleted (its chains before its sets,
    # once no rule looks them up), then the whole table again.
    assert rest == ("flush chain ip kpx_t fw_0\nflush map ip kpx_t firewall\n"
                    "flush set ip kpx_t vips\nflush chain ip kpx_t guard\n"
                    "delete chain ip kpx_t fw_1\ndelete chain ip kpx_t fw_2\n"
                    "delete set ip kpx_t old\n" + t.filled)
    assert "delete" not in t.in_place(t.names).replace(t.filled, "")
