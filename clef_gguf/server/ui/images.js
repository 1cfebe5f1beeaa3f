// Images dropped or chosen on the page, within the server's limits (how many, how large, which types).
import { $, el } from "./dom.js";
import { page } from "./page.js";

function renderImages() {
  $("image-list").replaceChildren(...page.images.map((image, i) => {
    const remove = el("button", { type: "button", text: "Remove", "aria-label": `Remove image ${image.name}` });
    remove.addEventListener("click", () => { page.images.splice(i, 1); renderImages(); $("image-input").focus(); });
    return el("li", {}, el("span", { text: `${image.name} (${Math.ceil(image.size / 1024)} KiB)` }), remove);
  }));
}

const mib = (bytes) => `${bytes / (1 << 20)} MiB`;

function addImages(files) {
  const { images, image_bytes: imageBytes, image_types: types } = page.limits;
  $("images-error").textContent = "";
  for (const file of files) {
    let why = "";
    if (page.images.length >= images) why = `at most ${images} images`;
    else if (!types.includes(file.type)) why = "not a PNG, JPEG or WebP image";
    else if (file.size > imageBytes) why = `over ${mib(imageBytes)}`;
    if (why) {
      $("images-error").textContent = `${file.name}: ${why}`;
      continue;
    }
    const entry = { name: file.name, size: file.size, url: "" };
    page.images.push(entry);
    const reader = new FileReader();
    reader.addEventListener("load", () => { entry.url = String(reader.result); });
    reader.readAsDataURL(file);
  }
  renderImages();
}

export function imagesNote() {
  const { images, image_bytes: imageBytes } = page.limits;
  return page.imagesOn
    ? `Up to ${images} images (PNG, JPEG or WebP, each up to ${mib(imageBytes)}), placed before the state.`
    : "This server has no vision tower, so it takes no images: start it with `clef-gguf serve MODEL --mmproj MMPROJ` to send some.";
}

export function wireImages() {
  $("image-input").accept = page.limits.image_types.join(",");
  const drop = $("drop");
  drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    if (page.imagesOn) addImages([...event.dataTransfer.files]);
  });
  $("image-input").addEventListener("change", () => { addImages([...$("image-input").files]); $("image-input").value = ""; });
}
