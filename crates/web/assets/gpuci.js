// gpuci dashboard: live updates over server-sent events, and log search. Pages work without
// this file; it only keeps them current. Every fragment it inserts was rendered (and escaped)
// by the server.
"use strict";
(function () {
  function $(sel, root) { return (root || document).querySelector(sel); }

  // ---- the job page: live log, state and charts --------------------------------------------
  var log = $("#log");
  if (log) {
    var follow = $("#log-follow");
    var search = $("#log-search");
    var count = $("#log-count");
    var matches = [];
    var current = -1;

    var matchLine = function (li, q) {
      var t = li.querySelector(".t");
      return !q || (t && t.textContent.toLowerCase().indexOf(q) !== -1);
    };
    var applySearch = function () {
      var q = (search.value || "").toLowerCase();
      matches = [];
      current = -1;
      var lines = log.children;
      for (var i = 0; i < lines.length; i++) {
        var hit = matchLine(lines[i], q);
        lines[i].classList.toggle("hidden", !hit);
        lines[i].classList.remove("hit-current");
        if (q && hit) matches.push(lines[i]);
      }
      // While searching, folded sections show their matching lines.
      log.classList.toggle("searching", !!q);
      count.textContent = q ? matches.length + (matches.length === 1 ? " line matches" : " lines match") : "";
    };
    var jump = function (step) {
      if (!matches.length) return;
      if (current >= 0) matches[current].classList.remove("hit-current");
      current = (current + step + matches.length) % matches.length;
      var li = matches[current];
      li.classList.add("hit-current");
      li.scrollIntoView({ block: "center" });
      count.textContent = (current + 1) + " of " + matches.length;
    };
    search.addEventListener("input", applySearch);
    search.addEventListener("keydown", function (e) {
      if (e.key === "Enter") { e.preventDefault(); jump(e.shiftKey ? -1 : 1); }
      if (e.key === "Escape") { search.value = ""; applySearch(); }
    });
    document.addEventListener("keydown", function (e) {
      var tag = (e.target && e.target.tagName) || "";
      if (e.key === "/" && tag !== "INPUT" && tag !== "TEXTAREA" && tag !== "SELECT") { e.preventDefault(); search.focus(); }
    });
    if (location.hash && /^#L\d+$/.test(location.hash)) {
      var target = document.getElementById(location.hash.slice(1));
      if (target) { follow.checked = false; target.scrollIntoView({ block: "center" }); }
    }
    // Sections (`--- title`, `::group::title`, marked by the server as data-sec): each
    // header folds the lines after it, up to the next header or `::endgroup::`.
    var section = null;
    var setFold = function (head, folded) {
      head.classList.toggle("folded", folded);
      var b = head.querySelector(".sec-toggle");
      if (b) b.setAttribute("aria-expanded", folded ? "false" : "true");
      var lines = log.querySelectorAll('li[data-g="' + head.id + '"]');
      for (var i = 0; i < lines.length; i++) lines[i].classList.toggle("folded-out", folded);
    };
    var place = function (li) {
      var m = li.dataset.sec;
      if (m === "open") {
        section = li;
        var b = li.querySelector(".sec-toggle");
        if (b) {
          b.hidden = false;
          var t = li.querySelector(".sec-title");
          if (t) t.hidden = true;
          b.addEventListener("click", function () { setFold(li, !li.classList.contains("folded")); });
        }
        return;
      }
      if (section) {
        li.dataset.g = section.id;
        if (section.classList.contains("folded")) li.classList.add("folded-out");
      }
      if (m === "close") section = null;
    };
    for (var k = 0; k < log.children.length; k++) place(log.children[k]);
    // A failed job's last section is open: that is where it failed.
    if (section && log.dataset.live !== "1" && log.dataset.state !== "succeeded") setFold(section, false);
    var atBottom = function () { return log.scrollHeight - log.scrollTop - log.clientHeight < 40; };
    if (follow.checked && !location.hash) log.scrollTop = log.scrollHeight;
    log.addEventListener("scroll", function () { if (!atBottom()) follow.checked = false; });

    if (log.dataset.live === "1" && window.EventSource) {
      var job = log.dataset.job;
      var es = new EventSource("/ui/jobs/" + job + "/events?after=" + encodeURIComponent(log.dataset.after));
      var q = function () { return (search.value || "").toLowerCase(); };
      es.addEventListener("line", function (e) {
        var d = JSON.parse(e.data);
        if (document.getElementById("L" + d.seq)) return;
        log.insertAdjacentHTML("beforeend", d.html);
        log.dataset.after = d.seq;
        // A page following a long log keeps the newest lines only (the raw log has all).
        while (log.children.length > 20000) {
          log.removeChild(log.firstElementChild);
        }
        var li = log.lastElementChild;
        if (li) place(li);
        if (q() && li) {
          var hit = matchLine(li, q());
          li.classList.toggle("hidden", !hit);
          if (hit) { matches.push(li); count.textContent = matches.length + " lines match"; }
        }
        if (follow.checked) log.scrollTop = log.scrollHeight;
      });
      es.addEventListener("state", function (e) {
        var d = JSON.parse(e.data);
        $("#job-state").innerHTML = d.badge;
        $("#job-reason").textContent = d.reason;
        $("#job-duration").textContent = d.duration;
      });
      es.addEventListener("charts", function (e) {
        var c = $("#charts");
        if (c) c.innerHTML = JSON.parse(e.data).html;
      });
      es.addEventListener("end", function () {
        es.close();
        log.dataset.live = "0";
        // The finished job's facts, buttons and charts, from a fresh copy of the page.
        fetch(location.pathname, { credentials: "same-origin" }).then(function (r) { return r.text(); }).then(function (text) {
          var doc = new DOMParser().parseFromString(text, "text/html");
          ["dl.facts", ".actions", "#charts"].forEach(function (sel) {
            var now = $(sel), fresh = $(sel, doc);
            if (now && fresh) now.innerHTML = fresh.innerHTML;
          });
          $("#live-status").textContent = "The job ended: " + $("#job-reason").textContent;
        });
      });
    }
  }

  // ---- lists: jobs, pipeline, queue, fleet ------------------------------------------------
  var live = $("#live[data-live]");
  if (live && window.EventSource && !log) {
    var pending = null;
    var refresh = function () {
      pending = null;
      fetch(location.href, { credentials: "same-origin" }).then(function (r) { return r.ok ? r.text() : null; }).then(function (text) {
        if (!text) return;
        var fresh = $("#live", new DOMParser().parseFromString(text, "text/html"));
        if (!fresh || fresh.innerHTML === live.innerHTML) return;
        // Keep the keyboard where it was: the same element (by id or link) after the swap.
        var a = document.activeElement, id = a && a.id, href = a && a.getAttribute && a.getAttribute("href");
        var inside = a && live.contains(a);
        live.setAttribute("aria-busy", "true");
        live.innerHTML = fresh.innerHTML;
        live.removeAttribute("aria-busy");
        if (inside) {
          var back = (id && document.getElementById(id)) || (href && live.querySelector('a[href="' + CSS.escape(href) + '"]'));
          if (back) back.focus();
        }
      });
    };
    var soon = function () { if (!pending) pending = setTimeout(refresh, 700); };
    var events = new EventSource("/ui/events");
    events.addEventListener("job", soon);
    if (live.dataset.live === "fleet") setInterval(soon, 5000);
  }
})();
